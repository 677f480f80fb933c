"""The staged KV send path on CUDA (issue 14 item 1, issue 16 items 4 and 5): gather on the
device through a bounded scratch, non-blocking copies into the pinned staging arena on a
side stream, a CUDA event the I/O thread waits on; a full CUDA-IPC budget holds the KV in
its blocks.

Plain torch and real connectors (shared memory, CUDA IPC), no vLLM (``make test-gpu`` on
any CUDA machine). The caches are what vLLM 0.32's CUDA backends hand the runner: per
layer a ``[num_blocks, heads, block, K+V]`` logical view, K then V packed in the last dim,
over any of vLLM's physical orders (``KVCacheLayout`` names). Times of the caller (the
model thread) are printed (``-s``), never gated.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid

import pytest
import torch

from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.layout import packed_layout
from vllm_kvbridge.kv.manager import KVTransferManager
from vllm_kvbridge.kv.staged import Stager
from vllm_kvbridge.kv.topology import TPTopology
from vllm_kvbridge.wire import decode_packed
from vllm_kvbridge.wire.kv_format import KEY, VALUE

# CUDA is there: tests/gpu/conftest.py fails the run without it (no silent skips).
pytestmark = pytest.mark.cuda

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 4, 64, 4, 16, 64
SEQ = 7 * BLOCK + 5
ORDERS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]


def _caches(order: str, *, blocks: int = BLOCKS, heads: int = HEADS, head: int = HEAD, v: int | None = None):
    """Per-layer logical ``[B, H, N, K+V]`` views over one cache stored in physical ``order``."""
    v = head if v is None else v
    dims = {"L": LAYERS, "B": blocks, "H": heads, "N": BLOCK, "C": head + v}
    gen = torch.Generator().manual_seed(3)
    physical = torch.randn(*[dims[d] for d in order], generator=gen).to(torch.bfloat16).cuda()
    logical = physical.permute(*[order.index(d) for d in "LBHNC"])
    return [logical[i] for i in range(LAYERS)]


def _reference(
    cache: torch.Tensor, block_ids: list[int], seq: int = SEQ
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (of equal sizes) of the first ``seq`` tokens of ``block_ids``, on the CPU."""
    pages = cache.cpu()[block_ids]  # [nb, H, N, C]
    tokens = pages.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[-1])[:seq]
    return tokens[..., : cache.shape[-1] // 2], tokens[..., cache.shape[-1] // 2 :]


def _ready_stager(sender: KVTransferManager, caches, **kw) -> Stager:
    """The sender's stager made now and its pinned arena ready (a stage makes it at its
    first send, pinned in the background; a test wants it there)."""
    stager = Stager(kw.pop("capacity", 256 << 20), caches[0].device, **kw)
    sender._stager = stager
    return stager


def _edge(ns: str, **kv) -> tuple[KVTransferManager, KVTransferManager]:
    shared = {"connector_config": {"namespace": ns, **kv.pop("connector_config", {})}, **kv}
    sender = KVTransferManager(
        KVTransferConfig(need_send_cache=True, stage_id=0, to_stage=1, staging_bytes=256 << 20, **shared),
        num_kv_heads=HEADS,
    )
    receiver = KVTransferManager(
        KVTransferConfig(need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=20, **shared),
        num_kv_heads=HEADS,
    )
    return sender, receiver


def _send(
    sender: KVTransferManager, caches, rid: str, block_ids: list[int], order: str, *, held=True
) -> list:
    sender.layout = packed_layout(HEADS, HEAD, BLOCK, torch.bfloat16, physical_order=order)
    info = {rid: {"block_ids": block_ids, "seq_len": SEQ, "blocks_held": held}}
    deferred: list[str] = []
    submitted = sender.handle_finished_requests_kv_transfer(info, caches, BLOCK, "auto", deferred=deferred)
    assert submitted == [rid] or deferred == [rid]
    return deferred


def _until_done(sender: KVTransferManager, rid: str) -> None:
    end = time.monotonic() + 30
    while True:
        done, failed = sender.get_finished()
        assert not failed, sender.send_failure_reason(rid)
        if rid in done:
            return
        assert time.monotonic() < end
        time.sleep(0.005)


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
def test_staged_gather_from_a_cuda_cache_equals_the_cpu_reference(order: str) -> None:
    caches = _caches(order)
    block_ids = [int(b) for b in torch.randperm(BLOCKS)[:8]]
    sender, receiver = _edge(f"gpustg{order}{os.getpid()}")
    try:
        _ready_stager(sender, caches)
        assert _send(sender, caches, "r", block_ids, order) == []
        _until_done(sender, "r")
        data, _ = receiver.receive_kv_cache_for_request("r")
        for layer, cache in enumerate(caches):
            k, v = _reference(cache, block_ids)
            assert torch.equal(data.key_cache[layer], k) and torch.equal(data.value_cache[layer], v)
        stats = sender.staging_stats()
        assert stats is not None and stats["pinned"] and stats["bypassed"] == 0
    finally:
        receiver.shutdown()
        sender.shutdown()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("bpb", [1, 2])
def test_the_chunked_staged_gather_of_every_cuda_layout_and_route_is_exact(order: str, bpb: int) -> None:
    """Every physical order, scheduler blocks of 1 and 2 kernel blocks, K and V of different
    sizes, two receiver ranks (head slices), a scratch far smaller than a layer: each
    route's staged payload equals the CPU reference."""
    from vllm_kvbridge.kv.send import gather_job

    heads, head, v = 4, 64, 32
    caches = _caches(order, blocks=BLOCKS * bpb, heads=heads, head=head, v=v)
    layout = packed_layout(
        heads, head, BLOCK, torch.bfloat16, head_size_v=v, physical_order=order, blocks_per_block=bpb
    )
    block_ids = [int(b) for b in torch.randperm(BLOCKS)[:8]]
    seq = 7 * layout.tokens_per_block + 5
    tensor_blocks = [b * bpb + j for b in block_ids for j in range(bpb)]
    topo = TPTopology(1, 2, heads)
    # Slots of two scheduler blocks of K of one route (heads / 2): several chunks per layer.
    stager = Stager(64 << 20, caches[0].device, scratch_bytes=2 * 2 * BLOCK * bpb * (heads // 2) * head * 2)
    info = {"block_ids": block_ids, "seq_len": seq, "blocks_held": True}
    try:
        job = gather_job(
            "e", "r", info, caches, layout, topo, topo.routes_from(0), 0, 1, lambda: None, stager
        )
        job.fence.wait()
        assert len(job.parts) == 2 and stager.stats()["scratch_bytes"] < 1 << 20
        for (_, _, part), route in zip(job.parts, topo.routes_from(0), strict=True):
            data = decode_packed(part.buffer[: part.nbytes], copy=True)
            hs, he = route.src_heads.start, route.src_heads.end
            for layer, cache in enumerate(caches):
                pages = (
                    cache.cpu()[tensor_blocks].permute(0, 2, 1, 3).reshape(-1, heads, head + v)[:seq, hs:he]
                )
                assert torch.equal(data.key_cache[layer], pages[..., :head]), (layer, KEY)
                assert torch.equal(data.value_cache[layer], pages[..., head:]), (layer, VALUE)
        job.release()
    finally:
        stager.close()


def test_the_model_thread_does_not_wait_for_the_copy_and_the_blocks_wait_for_its_event() -> None:
    caches = _caches("LBHNC")
    block_ids = list(range(8))
    sender, receiver = _edge(f"gpustgev{os.getpid()}")
    try:
        _ready_stager(sender, caches)
        _send(sender, caches, "warm", block_ids, "LBHNC")  # pools and allocator warmed
        _until_done(sender, "warm")
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of work ahead of the gather on the stream
        t0 = time.perf_counter()
        _send(sender, caches, "r", block_ids, "LBHNC")
        caller = time.perf_counter() - t0
        # The call returned with the copy still queued: the blocks must stay held.
        assert sender.copies_in_flight({"r"}) == {"r"}
        print(
            f"\ncaller (model thread) time of a staged send behind 0.5 s of GPU work: {caller * 1e3:.2f} ms"
        )
        _until_done(sender, "r")  # the I/O thread waited on the event, then published
        assert sender.copies_in_flight({"r"}) == set()
        data, _ = receiver.receive_kv_cache_for_request("r")
        k, v = _reference(caches[0], block_ids)
        assert torch.equal(data.key_cache[0], k) and torch.equal(data.value_cache[0], v)
    finally:
        receiver.shutdown()
        sender.shutdown()


def _pinned_by_torch() -> int:
    """Bytes torch's caching pinned allocator holds (the staging arena is not among them)."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return int(stats.get("allocated_bytes.current", stats.get("allocated_bytes.all.current", 0)))


def test_device_and_pinned_memory_stay_bounded_over_a_thousand_sends_whatever_their_size() -> None:
    """Device memory the sends use outside the caches is the scratch (2 MiB here), also for
    a request of 32 MiB of KV; pinned memory is the arena (its budget, pinned once) and
    torch's pinned cache does not grow; 1,000 sends leave nothing behind."""
    big_blocks = 512
    caches = _caches("LBHNC", blocks=big_blocks, heads=8, head=128)
    layout = packed_layout(8, 128, BLOCK, torch.bfloat16, physical_order="LBHNC")
    ns = f"gpustgleak{os.getpid()}"
    shared = {"connector_config": {"namespace": ns}}
    sender = KVTransferManager(
        KVTransferConfig(need_send_cache=True, stage_id=0, to_stage=1, staging_bytes=256 << 20, **shared),
        num_kv_heads=8,
        layout=layout,
    )
    receiver = KVTransferManager(
        KVTransferConfig(need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=20, **shared),
        num_kv_heads=8,
    )
    scratch = 2 << 20

    def send(rid: str, block_ids: list[int], seq: int) -> None:
        info = {rid: {"block_ids": block_ids, "seq_len": seq, "blocks_held": True}}
        assert sender.handle_finished_requests_kv_transfer(info, caches, BLOCK, "auto") == [rid]
        _until_done(sender, rid)
        receiver.receive_kv_cache_for_request(rid)
        receiver.pop_received(rid)

    try:
        _ready_stager(sender, caches, scratch_bytes=scratch)
        big = list(range(128))  # 2048 tokens: 4 MiB per layer and kind, 32 MiB of KV
        for i in range(10):  # warm up: streams, allocator, the scratch, torch's pinned cache
            send(f"w{i}", [(i + 3 * k) % big_blocks for k in range(8)], 8 * BLOCK - 3)
            send(f"wb{i}", big, 128 * BLOCK)
        torch.cuda.synchronize()
        before, pinned_before = torch.cuda.memory_allocated(), _pinned_by_torch()
        torch.cuda.reset_peak_memory_stats()
        for i in range(3):
            send(f"big{i}", big, 128 * BLOCK)
        big_peak = torch.cuda.max_memory_allocated() - before
        for i in range(1000):
            send(f"r{i}", [(i + 3 * k) % big_blocks for k in range(8)], 8 * BLOCK - 3)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        stats = sender.staging_stats()
        print(
            f"\ndevice bytes over the caches: peak {peak} (a 32 MiB request: {big_peak}), scratch "
            f"{stats['scratch_bytes']}; pinned: arena {stats['allocated']} of {stats['capacity']}, "
            f"torch's pinned cache {pinned_before} -> {_pinned_by_torch()}"
        )
        assert torch.cuda.memory_allocated() == before
        assert stats["scratch_bytes"] == scratch
        assert big_peak <= scratch + (1 << 20) and peak <= scratch + (1 << 20)  # + block indices
        assert stats["in_use"] == 0 and stats["allocated"] == 256 << 20 and stats["capacity"] == 256 << 20
        assert _pinned_by_torch() <= pinned_before
    finally:
        receiver.shutdown()
        sender.shutdown()


# -- a full CUDA-IPC budget ---------------------------------------------------------------------
def _ipc_edge(token: str, pool_bytes: int):
    shared = {
        "connector": "CudaIpcConnector",
        "connector_config": {"namespace": token, "pool_bytes": pool_bytes},
    }
    sender = KVTransferManager(
        KVTransferConfig(need_send_cache=True, stage_id=0, to_stage=1, staging_bytes=64 << 20, **shared),
        num_kv_heads=HEADS,
        layout=packed_layout(HEADS, HEAD, BLOCK, torch.bfloat16, physical_order="LBHNC"),
    )
    receiver = KVTransferManager(
        KVTransferConfig(need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=20, **shared),
        num_kv_heads=HEADS,
    )
    return sender, receiver


def test_a_full_cuda_ipc_budget_holds_the_kv_in_its_blocks_and_never_copies_through_the_host() -> None:
    """Room for one request's KV: the second finished request is deferred (blocks held,
    nothing gathered, no host copy), cheaply for the model thread; once the first is read
    it is gathered into the lent device buffer and arrives exact. A running request's send
    into the full budget waits in the staging pool, copied off the model thread."""
    caches = _caches("LBHNC")
    ids = {
        "a": [9, 3, 40, 41, 7, 0, 63, 12],
        "b": [1, 2, 4, 5, 6, 8, 10, 11],
        "c": [13, 14, 15, 16, 17, 18, 19, 20],
    }
    kv_bytes = 2 * LAYERS * SEQ * HEADS * HEAD * 2
    token = "t" + uuid.uuid4().hex[:12]
    sender, receiver = _ipc_edge(token, pool_bytes=kv_bytes + kv_bytes // 2)
    try:
        _ready_stager(sender, caches, capacity=64 << 20)

        def send(rid: str, held: bool = True) -> list[str]:
            deferred: list[str] = []
            info = {rid: {"block_ids": ids[rid], "seq_len": SEQ, "blocks_held": held}}
            sender.handle_finished_requests_kv_transfer(info, caches, BLOCK, "auto", deferred=deferred)
            return deferred

        assert send("a") == []
        _until_done(sender, "a")
        times = []
        for _ in range(20):  # engine steps while the budget stays full
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            assert send("b") == ["b"]
            times.append(time.perf_counter() - t0)
        print(
            "\ncaller time of a deferred send (CUDA-IPC budget full): "
            f"median {statistics.median(times) * 1e3:.3f} ms"
        )
        assert sender.queued_send_bytes() == 0 and sender.pending_sends() == 0
        stats = sender.staging_stats()
        assert stats["peak"] == 0 and stats["bypassed"] == 0 and stats["reserve_full"] == 20, stats
        assert "pool_bytes=" in stats["reserve_full_reason"]

        got, _ = receiver.receive_kv_cache_for_request("a")
        del got
        end = time.monotonic() + 30
        while send("b"):  # room comes back with the receiver's acknowledgement
            assert time.monotonic() < end
            time.sleep(0.01)
        _until_done(sender, "b")  # gathered straight into the lent buffer: the budget is full again

        refused = sender.connector.health()["put_full"]
        t0 = time.perf_counter()
        assert send("c", held=False) == []  # a running request: staged, its put waits for room
        caller = time.perf_counter() - t0
        print(f"caller time of a running request's send into the full budget: {caller * 1e3:.3f} ms")
        end = time.monotonic() + 30
        while sender.staging_stats()["in_use"] == 0 or sender.connector.health()["put_full"] < refused + 2:
            assert time.monotonic() < end, sender.staging_stats()  # c waits in the pool
            time.sleep(0.01)
        for rid in ("b", "c"):
            data, _ = receiver.receive_kv_cache_for_request(rid)
            k, v = _reference(caches[0], ids[rid])
            assert torch.equal(data.key_cache[0].cpu(), k) and torch.equal(data.value_cache[0].cpu(), v)
            del data
        _until_done(sender, "c")
        assert sender.staging_stats()["in_use"] == 0
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_the_caller_time_of_a_send_that_finds_the_staging_pool_full() -> None:
    caches = _caches("LBHNC")
    sender, receiver = _edge(f"gpustgfull{os.getpid()}")
    try:
        stager = _ready_stager(sender, caches, capacity=1 << 20)  # one buffer
        held = stager.pool.acquire(1)  # taken: every send finds the pool full
        times = []
        for i in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            assert _send(sender, caches, f"r{i}", list(range(8)), "LBHNC") == [f"r{i}"]
            times.append(time.perf_counter() - t0)
        print(
            "\ncaller time of a deferred send (staging pool full): "
            f"median {statistics.median(times) * 1e3:.3f} ms"
        )
        assert sender.staging_stats()["deferred"] == 20
        held.release()
    finally:
        receiver.shutdown()
        sender.shutdown()
