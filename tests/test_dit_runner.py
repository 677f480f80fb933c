"""The diffusion runner's receive path: real SharedMemoryConnector, real KV manager, no engine.

The KV is sent by a sender-side KVTransferManager from fake paged caches in vLLM's CPU
layout (the same helper the KV manager tests use), received by the runner's own manager
(prefetched for the second request), and must equal the reference gather exactly; the
image must equal a denoise run on that reference KV.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_fixtures import fake_cpu_caches, reference_kv, request_plan
from runner_fixtures import send_cfg_kv

from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.errors import TransferCorrupt, TransferTimeout
from vllm_kvbridge.models.guidance import CFG_NEGATIVE
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
from vllm_kvbridge.pipeline.cfg import companion_request_id
from vllm_kvbridge.runner.diffusion_batch import select_batch
from vllm_kvbridge.runner.diffusion_runner import DiffusionRequest, DiffusionRunner, denoise


def _stage(
    namespace: str,
    recv_timeout: float = 10.0,
    dump_dir: str | None = None,
    dit_kwargs: dict[str, Any] | None = None,
    expect: dict[str, Any] | None = None,
    max_batch_size: int = 1,
    class_path: str = "vllm_kvbridge.models.tiny_dit.TinyKVDiT",
):
    kv_transfer = {"need_recv_cache": True, "recv_timeout": recv_timeout, "prefetch": True}
    if expect is not None:
        kv_transfer["expect"] = expect
    cfg = {
        "connectors": {"shm": {"name": "shm", "extra": {"namespace": namespace}}},
        "stages": [
            {"stage_id": 0, "kind": "llm_ar", "model": "m", "kv_transfer": {"need_send_cache": True}},
            {
                "stage_id": 1,
                "kind": "diffusion",
                "kv_transfer": kv_transfer,
                "diffusion": {
                    "class_path": class_path,
                    # model "m" is a placeholder (not readable): the KV geometry of the fake
                    # caches is given here (config/kv_geometry.py falls back to it)
                    "kwargs": {"image_size": 16, "kv_heads": 2, "kv_head_dim": 32, **(dit_kwargs or {})},
                    "num_steps": 3,
                    "max_batch_size": max_batch_size,
                },
            },
        ],
        "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
        "runtime": {"debug_dump_dir": dump_dir},
    }
    return resolve_spec(spec_from_dict(cfg)).stage(1)


def _leftovers(namespace: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f".{namespace}." in n]


@pytest.mark.forked
def test_receive_prefetch_and_denoise_exact(tmp_path: Path) -> None:
    ns = f"ditrun{os.getpid()}"
    caches = fake_cpu_caches(2, seed=5)
    plans = {"a-1": request_plan(1), "b-2": request_plan(2)}
    with send_cfg_kv(ns, caches, plans) as sender:  # sent, every send done
        runner = DiffusionRunner(_stage(ns, dump_dir=str(tmp_path)))
        try:
            reqs = [DiffusionRequest(f"user-{rid}", rid, 0, sender.get_sender_info(rid)) for rid in plans]
            runner.prefetch(reqs[1])
            outs = [runner.execute(r) for r in reqs]
        finally:
            runner.close()
        for req, out in zip(reqs, outs):
            keys, values = reference_kv(caches, plans[req.transfer_request_id])
            want = denoise(runner.module, list(zip(keys, values)), num_steps=3, seed=0)[0]
            assert out.image.shape == (3, 16, 16)
            assert torch.equal(out.image, want)
            assert out.kv_bytes == sum(k.numel() * 4 * 2 for k in keys)
            # the debug dump holds exactly the KV the stage consumed
            from safetensors.torch import load_file

            dumped = load_file(str(tmp_path / f"stage1_i{req.request_id}_kv.safetensors"))
            for i, (k, v) in enumerate(zip(keys, values)):
                assert torch.equal(dumped[f"layer{i}.k"], k) and torch.equal(dumped[f"layer{i}.v"], v)
    shutil.rmtree(tmp_path)
    assert _leftovers(ns) == []


@pytest.mark.forked
@pytest.mark.parametrize(
    ("dit_kwargs", "expect", "why"),
    [
        # heads are checked as soon as the first piece's header is read (the TP routing needs them)
        ({"kv_heads": 4}, None, "has 2 KV heads in all; this stage expects 4"),
        ({"kv_head_dim": 64}, None, "head_dim: sender 32, stage 1 expects 64"),
        ({}, {"dtype": "bfloat16"}, "dtype: sender 'float32', stage 1 expects 'bfloat16'"),
        ({}, {"num_layers": 5}, "num_layers: sender 3, stage 1 expects 5"),
    ],
)
def test_a_kv_the_stage_cannot_use_fails_naming_both_sides(dit_kwargs, expect, why) -> None:  # type: ignore[no-untyped-def]
    """Issue 15, item 4: KV whose heads / head dim / dtype / layers differ from what the
    module attends with (or the config expects) fails that request, naming both values,
    before the model sees it (it used to surface as a reshape error, or as garbage)."""
    ns = f"ditcompat{os.getpid()}"
    with send_cfg_kv(ns, fake_cpu_caches(2, seed=3), {"c-1": request_plan(1)}) as sender:
        runner = DiffusionRunner(_stage(ns, dit_kwargs=dit_kwargs, expect=expect))
        try:
            with pytest.raises(TransferCorrupt) as err:
                runner.execute(DiffusionRequest("u", "c-1", 0, sender.get_sender_info("c-1")))
            assert why in str(err.value), str(err.value)
        finally:
            runner.close()
    assert _leftovers(ns) == []


@pytest.mark.forked
def test_missing_kv_fails_the_request_at_the_deadline() -> None:
    ns = f"ditmiss{os.getpid()}"
    runner = DiffusionRunner(_stage(ns, recv_timeout=0.5))
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            runner.execute(DiffusionRequest("u", "never-sent", 0, {}))
        assert 0.4 < time.monotonic() - t0 < 5
    finally:
        runner.close()
    assert _leftovers(ns) == []


@pytest.mark.forked
@pytest.mark.timeout(120)
def test_an_abort_stops_a_denoise_under_way_and_the_stage_serves_the_next() -> None:
    """A request aborted while it denoises (its KV already consumed) stops within a step:
    it reports nothing (nobody waits for it) and the next request is served, instead of
    the stage spending every one of the aborted request's steps first."""
    from vllm_kvbridge.errors import RequestCancelled
    from vllm_kvbridge.pipeline import messages as m
    from vllm_kvbridge.pipeline.engines import build_engine

    ns = f"ditabort{os.getpid()}"
    caches = fake_cpu_caches(2, seed=5)
    plans = {"long-1": request_plan(1), "next-2": request_plan(2)}
    keys, values = reference_kv(caches, plans["long-1"])
    calls = iter(range(100))
    module = DiffusionRunner(_stage(ns)).module
    with pytest.raises(RequestCancelled, match="step 2 of 50"):  # asked before every step
        denoise(module, list(zip(keys, values)), num_steps=50, seed=0, cancelled=lambda: next(calls) >= 2)

    def until(predicate: Any, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while not predicate() and time.monotonic() < end:
            time.sleep(0.02)
        return bool(predicate())

    with send_cfg_kv(ns, caches, plans) as sender:  # sent, every send done

        def submit(rid: str, steps: int) -> m.Submit:
            return m.Submit(
                rid,
                sampling_params={"num_steps": steps},
                upstream=[m.Upstream(0, rid, sender.get_sender_info(rid))],
            )

        engine = build_engine(_stage(ns))
        try:
            engine.submit(submit("long-1", 10_000_000))  # would denoise for days
            # its KV is consumed (the segment is gone): it is past the receive, denoising
            assert until(lambda: not [n for n in _leftovers(ns) if ".ilong-1." in n], 30)
            engine.abort(["long-1"])
            engine.submit(submit("next-2", 3))
            out: list = []
            until(lambda: out.extend(engine.step()) or out, 60)
        finally:
            engine.close()
    assert [(type(x).__name__, x.request_id) for x in out] == [("StageDone", "next-2")]
    assert _leftovers(ns) == []


# -- batching (diffusion.max_batch_size) ----------------------------------------------------


def test_batch_selection_policy() -> None:
    """The head, then later requests of the head's steps in arrival order, up to the size;
    aborted ones the scan passes are dropped, others wait (arrival order kept)."""
    steps = {"a": 8, "b": 4, "c": 8, "x": 8, "d": 8, "e": 8}
    queue = ["a", "b", "c", "x", "d", "e"]
    pick = lambda q, n: select_batch(q, n, steps.__getitem__, lambda r: r == "x")  # noqa: E731
    assert pick(queue, 3) == ([0, 2, 4], [3])  # a c d; x (aborted) passed, dropped; b waits
    assert pick(queue, 1) == ([0], [])
    assert pick(queue, 8) == ([0, 2, 4, 5], [3])
    assert pick(["x", "b", "a"], 2) == ([1], [0])  # an aborted head never leads a batch
    assert pick(["x"], 4) == ([], [0])


@pytest.mark.forked
def test_a_batch_receives_each_kv_and_a_failed_receive_fails_that_request_alone() -> None:
    """Three requests of different prompt lengths and seeds (one guided, with its companion)
    and one whose KV never comes: that one fails with TransferTimeout, the others are
    denoised together, each exactly as it is alone."""
    ns = f"ditbatch{os.getpid()}"
    caches = fake_cpu_caches(2, seed=5)
    cid = companion_request_id("g-3", CFG_NEGATIVE)
    plans = {
        "a-1": request_plan(1),
        "g-3": request_plan(3),
        cid: {**request_plan(4), "purpose": CFG_NEGATIVE, "companion_of": "g-3"},
        "b-2": request_plan(2),
    }
    with send_cfg_kv(ns, caches, plans) as sender:
        runner = DiffusionRunner(_stage(ns, recv_timeout=0.5, max_batch_size=4))
        try:
            info_g = {
                "keys": {**sender.get_sender_info("g-3")["keys"], **sender.get_sender_info(cid)["keys"]}
            }
            reqs = [
                DiffusionRequest("a", "a-1", 0, sender.get_sender_info("a-1"), seed=0),
                DiffusionRequest(
                    "g", "g-3", 0, info_g, seed=5, guidance_scale=3.0, cfg_purposes=[CFG_NEGATIVE]
                ),
                DiffusionRequest("never", "never", 0, {}, seed=1),
                DiffusionRequest("b", "b-2", 0, sender.get_sender_info("b-2"), seed=2),
            ]
            runner.prefetch(reqs[3])
            out = runner.execute_batch(reqs)
        finally:
            runner.close()
    assert isinstance(out[2], TransferTimeout), out[2]
    module = TinyKVDiT(image_size=16, seed=0).eval()

    def ref(rid: str) -> list:
        keys, values = reference_kv(caches, plans[rid])
        return list(zip(keys, values))

    want = {
        "a": denoise(module, ref("a-1"), num_steps=3, seed=0)[0],
        "g": denoise(module, ref("g-3"), num_steps=3, seed=5, uncond_kv=ref(cid), guidance_scale=3.0)[0],
        "b": denoise(module, ref("b-2"), num_steps=3, seed=2)[0],
    }
    for got in (out[0], out[1], out[3]):
        assert not isinstance(got, Exception), got
        assert torch.equal(got.image, want[got.request_id]), got.request_id
        assert got.batch_size == 3
    assert set(out[1].kv_transfers) == {"kv", CFG_NEGATIVE}
    assert _leftovers(ns) == []


class GateDiT(TinyKVDiT):
    """TinyKVDiT whose forwards wait for ``GateDiT.gate`` and record the rows of each call
    (the engine runs it in this process, on its worker thread)."""

    gate = threading.Event()
    entered = threading.Event()
    calls: list[tuple[str, int]] = []

    def forward(self, latents: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        GateDiT.entered.set()
        GateDiT.gate.wait(60)
        GateDiT.calls.append(("forward", latents.shape[0]))
        return super().forward(latents, *args, **kwargs)

    def forward_batch(self, latents: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        GateDiT.gate.wait(60)
        GateDiT.calls.append(("batch", latents.shape[0]))
        return super().forward_batch(latents, *args, **kwargs)


@pytest.mark.forked
@pytest.mark.timeout(120)
def test_the_engine_batches_queued_requests_of_one_step_count_in_arrival_order() -> None:
    """While ``first`` denoises, r1..r5 queue (r2 with other steps, r5 then aborted): the
    next batch is r1 r3 r4 (max 3, the head's steps, arrival order), then r2 alone; r5 is
    dropped (its KV consumed, nothing reported). Every image equals its unbatched run."""
    from vllm_kvbridge.pipeline import messages as m
    from vllm_kvbridge.pipeline.engines import build_engine

    ns = f"ditbatcheng{os.getpid()}"
    caches = fake_cpu_caches(2, seed=5)
    ids = ["first", "r1", "r2", "r3", "r4", "r5"]
    plans = {rid: request_plan(i + 1) for i, rid in enumerate(ids)}
    steps = {"first": 3, "r1": 3, "r2": 5, "r3": 3, "r4": 3, "r5": 3}
    GateDiT.calls.clear()
    with send_cfg_kv(ns, caches, plans) as sender:

        def submit(rid: str) -> m.Submit:
            return m.Submit(
                rid,
                sampling_params={"num_steps": steps[rid], "seed": ids.index(rid)},
                upstream=[m.Upstream(0, rid, sender.get_sender_info(rid))],
            )

        engine = build_engine(_stage(ns, max_batch_size=3, class_path="test_dit_runner.GateDiT"))
        out: list = []
        try:
            engine.submit(submit("first"))
            assert GateDiT.entered.wait(30)  # first is in its forward: the worker is busy
            for rid in ids[1:]:
                engine.submit(submit(rid))
            engine.abort(["r5"])
            GateDiT.gate.set()
            end = time.monotonic() + 60
            while len(out) < 5 and time.monotonic() < end:
                out.extend(engine.step())
                time.sleep(0.02)
            time.sleep(0.3)  # r5 would have been reported by now
            out.extend(engine.step())
        finally:
            engine.close()
    assert [(type(x).__name__, x.request_id) for x in out] == [
        ("StageDone", "first"),
        ("StageDone", "r1"),
        ("StageDone", "r3"),
        ("StageDone", "r4"),
        ("StageDone", "r2"),
    ]
    assert {x.request_id: x.output["batch_size"] for x in out} == {
        "first": 1,
        "r1": 3,
        "r3": 3,
        "r4": 3,
        "r2": 1,
    }
    assert GateDiT.calls == [("forward", 1)] * 3 + [("batch", 3)] * 3 + [("forward", 1)] * 5
    module = TinyKVDiT(image_size=16, seed=0).eval()
    for x in out:
        keys, values = reference_kv(caches, plans[x.request_id])
        want = denoise(
            module, list(zip(keys, values)), num_steps=steps[x.request_id], seed=ids.index(x.request_id)
        )
        assert torch.equal(torch.from_numpy(m.tensor_from_msg(x.image)), want[0]), x.request_id
    assert _leftovers(ns) == []
