"""The diffusion runner's receive path: real SharedMemoryConnector, real KV manager, no engine.

The KV is sent by a sender-side KVTransferManager from fake paged caches in vLLM's CPU
layout (the same helper the KV manager tests use), received by the runner's own manager
(prefetched for the second request), and must equal the reference gather exactly; the
image must equal a denoise run on that reference KV.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_fixtures import fake_cpu_caches, reference_kv, request_plan
from runner_fixtures import send_cfg_kv

from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.errors import TransferCorrupt, TransferTimeout
from vllm_kvbridge.runner.diffusion_runner import DiffusionRequest, DiffusionRunner, denoise


def _stage(
    namespace: str,
    recv_timeout: float = 10.0,
    dump_dir: str | None = None,
    dit_kwargs: dict[str, Any] | None = None,
    expect: dict[str, Any] | None = None,
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
                "diffusion": {"kwargs": {"image_size": 16, **(dit_kwargs or {})}, "num_steps": 3},
            },
        ],
        "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
        "runtime": {"debug_dump_dir": dump_dir},
    }
    return resolve_spec(spec_from_dict(cfg)).stage(1)


def _leftovers(namespace: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f".{namespace}." in n]


@pytest.mark.forked
def test_receive_prefetch_and_denoise_exact() -> None:
    tmp_path = Path(tempfile.mkdtemp(prefix="kvb-dit-"))
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
