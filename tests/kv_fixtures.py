"""Helpers for the KV tests: real vLLM cache views, hand-built references, worker extension."""

from __future__ import annotations

from typing import Any

# Imported for its side effect: makes pytest-forked 1.7.5 work with pytest 9 (the lead may
# move that fix into conftest.py; then this import can go).
import torch

from vllm_kvbridge.kv.layout import KVCacheLayout, KVContent

#: (num_blocks, heads, block_size, head_size)
ALL_PHYSICAL_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def vllm_layer_views(
    order: str,
    num_layers: int,
    num_blocks: int,
    heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> list[torch.Tensor]:
    """Per-layer cache views exactly as vLLM 0.32 builds them (``create_kv_cache_views``)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_interface import (
        KVCacheLayout as VLayout,
    )

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
    layout = VLayout[order]
    strides = compute_layout_strides(spec, num_blocks, num_layers, layout)
    size = spec.page_size_bytes * num_blocks * num_layers
    tensor = KVCacheTensor(
        size=size,
        layers=[f"l{i}" for i in range(num_layers)],
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    raw = torch.zeros(size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(size // torch.empty((), dtype=dtype).element_size(), generator=gen)
    raw.view(dtype).copy_(noise.to(dtype))
    return views


def reference_gather(
    cache: torch.Tensor,
    layout: KVCacheLayout,
    block_ids: list[int],
    seq_len: int,
    head_start: int = 0,
    head_end: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token reference built from the documented page formats, no vectorisation."""
    head_end = layout.num_kv_heads if head_end is None else head_end
    n, d, dv = layout.block_size, layout.head_size, layout.head_size_v
    k = torch.empty(seq_len, head_end - head_start, d, dtype=cache.dtype)
    v = torch.empty(seq_len, head_end - head_start, dv, dtype=cache.dtype)
    for t in range(seq_len):
        block, pos = block_ids[t // n], t % n
        for h in range(head_start, head_end):
            if layout.content is KVContent.PACKED:
                k[t, h - head_start] = cache[block, h, pos, :d]
                v[t, h - head_start] = cache[block, h, pos, d:]
            else:
                page = cache[block, h].reshape(-1)
                k[t, h - head_start] = page[pos : n * d : n]  # K half is [d, n]
                v[t, h - head_start] = page[n * d + pos * d : n * d + (pos + 1) * d]
    return k, v


class KVProbeExtension:
    """``worker_extension_cls`` for the engine test: reads the runner's KV state over RPC.

    Everything returned crosses vLLM's RPC boundary, so it returns plain lists.
    """

    def kvb_layout(self) -> dict[str, Any]:
        from vllm_kvbridge.kv.layout_vllm import layout_from_vllm

        runner = self.model_runner  # type: ignore[attr-defined]
        layout = layout_from_vllm(runner)
        return {
            "content": layout.content.value,
            "isa": layout.cpu_isa,
            "block_size": layout.block_size,
            "heads": layout.num_kv_heads,
            "head_size": layout.head_size,
            "order": layout.physical_order,
            "shape": list(runner.kv_caches[0].shape),
            "num_layers": len(runner.kv_caches),
            "backend": layout.backend,
        }

    def kvb_gather_blocks(self, block_ids: list[int], seq_len: int) -> list[list[list[float]]]:
        """Gathered (K, V) of every layer for the given blocks, as nested lists."""
        from vllm_kvbridge.kv.layout_vllm import layout_from_vllm
        from vllm_kvbridge.kv.paged import gather_layers

        runner = self.model_runner  # type: ignore[attr-defined]
        keys, values = gather_layers(runner.kv_caches, layout_from_vllm(runner), block_ids, seq_len)
        return [[k.flatten().tolist() for k in keys], [v.flatten().tolist() for v in values]]

    def kvb_record_block_ids(self) -> None:
        """Wrap the runner's execute_model so every step records each live request's block ids.

        After a request finishes the runner forgets it, but with no other traffic its
        blocks keep their contents, so the recorded ids can be gathered afterwards.
        """
        runner = self.model_runner  # type: ignore[attr-defined]
        recorded: dict[str, list[int]] = {}
        original = runner.execute_model

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            for rid, state in runner.requests.items():
                recorded[rid] = list(state.block_ids[0])
            return out

        runner.execute_model = execute_model
        self._kvb_recorded = recorded

    def kvb_recorded_block_ids(self) -> dict[str, list[int]]:
        return dict(self._kvb_recorded)


# -- manager helpers ---------------------------------------------------------------------------
NUM_LAYERS = 3
BLOCK = 32
HEAD = 32


def fake_cpu_caches(
    num_kv_heads: int, seed: int, num_blocks: int = 12, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Random per-layer caches in vLLM's CPU layout ([B, H, N, 2D])."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, num_kv_heads, BLOCK, 2 * HEAD, generator=gen).to(dtype)
        for _ in range(NUM_LAYERS)
    ]


def request_plan(i: int) -> dict[str, Any]:
    """Deterministic block ids / seq_len for request number i (non-contiguous blocks, odd lengths)."""
    seq_len = 1 + (i * 37) % 90
    nblocks = -(-seq_len // BLOCK)
    block_ids = [(i * 5 + 3 * k) % 12 for k in range(nblocks)]
    if len(set(block_ids)) != len(block_ids):
        block_ids = list(range(nblocks))[::-1]
    return {"block_ids": block_ids, "seq_len": seq_len}


def reference_kv(
    caches: list[torch.Tensor], plan: dict[str, Any], head_start: int = 0, head_end: int | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from vllm_kvbridge.kv.layout import cpu_layout

    layout = cpu_layout(caches[0].shape[1], HEAD, BLOCK, caches[0].dtype)
    keys, values = [], []
    for cache in caches:
        k, v = reference_gather(cache, layout, plan["block_ids"], plan["seq_len"], head_start, head_end)
        keys.append(k)
        values.append(v)
    return keys, values


def sender_main(
    connector: str,
    connector_config: dict[str, Any],
    request_ids: list[str],
    seed: int,
    info_queue: Any,
    stop_event: Any,
) -> None:
    """Child process: send the KV of ``request_ids`` and publish sender info; stay alive until told."""
    import time

    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.manager import KVTransferManager

    cfg = KVTransferConfig(
        need_send_cache=True, stage_id=0, to_stage=1, connector=connector, connector_config=connector_config
    )
    caches = fake_cpu_caches(2, seed)
    with KVTransferManager(cfg, num_kv_heads=2) as mgr:
        finished = {rid: request_plan(i) for i, rid in enumerate(request_ids)}
        mgr.handle_finished_requests_kv_transfer(finished, caches, BLOCK, "auto")
        done: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + 30
        while len(done | failed) < len(request_ids) and time.monotonic() < deadline:
            d, f = mgr.get_finished()
            done |= d
            failed |= f
            time.sleep(0.01)
        info_queue.put(
            {
                "done": sorted(done),
                "failed": sorted(failed),
                "info": {rid: mgr.get_sender_info(rid) for rid in done},
            }
        )
        stop_event.wait(60)


# -- TP / distribution workers (run in spawned processes) ---------------------------------------
TP_HEADS = 4


def tp_worker(rank: int, world: int, port: int, s: int, t: int, mode: str, ns: str, results: Any) -> None:
    """Ranks [0, s) send, ranks [s, s+t) receive; gloo groups per stage; results[rank] = outcome."""
    import torch.distributed as dist

    from vllm_kvbridge.errors import TransferError, TransferTimeout
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.layout import cpu_layout
    from vllm_kvbridge.kv.manager import KVTransferManager
    from vllm_kvbridge.kv.topology import rank_heads

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    senders = dist.new_group(list(range(s)))
    receivers = dist.new_group(list(range(s, s + t)))
    full = fake_cpu_caches(TP_HEADS, seed=21)
    plans = {"tp-a": request_plan(3), "tp-b": request_plan(8)}
    conn = {"namespace": ns}
    outcome: dict[str, Any] = {}
    try:
        if rank < s:
            held = rank_heads(rank, s, TP_HEADS)
            local = [c[:, held.start : held.end].contiguous() for c in full]
            to_tp = 1 if mode == "leader" else t
            cfg = KVTransferConfig(
                need_send_cache=True,
                stage_id=0,
                to_stage=1,
                from_tp=s,
                to_tp=to_tp,
                connector="SharedMemoryConnector",
                connector_config=conn,
            )
            layout = cpu_layout(held.size, HEAD, BLOCK, torch.float32)
            mgr = KVTransferManager(
                cfg, num_kv_heads=TP_HEADS, tp_rank=rank, layout=layout, process_group=senders
            )
            mgr.handle_finished_requests_kv_transfer(plans, local, BLOCK, "auto")
            done: set[str] = set()
            while len(done) < len(plans):
                d, f = mgr.get_finished()
                assert not f, f
                done |= d
            outcome["sent"] = sorted(done)
            dist.barrier()  # receivers are done: the segments may go
            mgr.shutdown()
        else:
            recv_rank = rank - s
            cfg = KVTransferConfig(
                need_recv_cache=True,
                stage_id=1,
                from_stage=0,
                from_tp=s,
                to_tp=1 if mode == "leader" else t,
                recv_timeout=20 if mode == "tp" else 3,
                distribution="leader" if mode == "leader" else "local",
                connector="SharedMemoryConnector",
                connector_config=conn,
            )
            mgr = KVTransferManager(cfg, num_kv_heads=TP_HEADS, tp_rank=recv_rank, process_group=receivers)
            outcome["role"] = mgr.role()
            want = (
                (0, TP_HEADS)
                if mode == "leader"
                else tuple(vars(rank_heads(recv_rank, t, TP_HEADS)).values())
            )
            for rid, plan in plans.items():
                assert mgr.receive_multi_kv_cache_distributed(rid)
                data = mgr.pop_received(rid).data
                keys, values = reference_kv(full, plan, *want)
                assert data.request_id == rid
                for layer in range(NUM_LAYERS):
                    assert torch.equal(data.key_cache[layer], keys[layer]), (rid, layer)
                    assert torch.equal(data.value_cache[layer], values[layer]), (rid, layer)
            outcome["exact"] = True
            if mode == "leader":  # the leader's failure reaches every follower as an error
                try:
                    mgr.receive_multi_kv_cache_distributed("never-sent")
                except TransferTimeout:
                    outcome["failure"] = "timeout"
                except TransferError as exc:
                    outcome["failure"] = f"error: {exc}"
            dist.barrier()
            mgr.shutdown()
    except BaseException as exc:
        outcome["error"] = repr(exc)
        raise
    finally:
        results[rank] = outcome
        dist.destroy_process_group()
