"""AR -> DiT with classifier-free guidance, end to end: one vLLM engine + the diffusion runner.

The shipped ``stage_configs/ar_to_dit_cfg.yaml`` (guidance_scale 4, a negative prompt), with
the LLM stage's connector wrapped so that the CFG companion of requests named ``fail*`` is
refused by the store (fault injection; everything else is the real SharedMemoryConnector).
One pipeline run checks the guided path, the per-request switch-off and the failure path.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from pipeline_fixtures import (
    COMPANION_GATE_ENV,
    ROOT,
    STAGE_ENV,
    descendants,
    hf_reference,
    load_dump,
    shm_segments,
)

from vllm_kvbridge.connectors.keys import encode_request_id
from vllm_kvbridge.models.guidance import CFG_NEGATIVE
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.runner.diffusion_runner import denoise

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DIT_KWARGS = {"image_size": 32, "patch_size": 4, "hidden": 64, "depth": 2, "kv_heads": 2, "kv_head_dim": 32}
NEGATIVE = "blurry, low quality"  # the config's negative_prompt


def _pump_until(pipe: Pipeline, cond: Any, timeout: float = 60.0) -> bool:
    """Drive the pipeline until ``cond()`` holds (True) or ``timeout`` passed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        pipe.poll(0.05)
    return bool(cond())


def _segments(pipe: Pipeline, part: str) -> list[str]:
    return [n for n in shm_segments(f"kvbridge.{pipe.run_id}") if part in n]


def _wait_unread(pipe: Pipeline, timeout: float = 60.0) -> bool:
    """Wait, without reading it, until a stage message reaches the orchestrator's socket."""
    assert pipe._control is not None
    return bool(pipe._control.sock.poll(int(timeout * 1000)))


def _layers(dump: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = len([k for k in dump if k.endswith(".k")])
    return [(dump[f"layer{i}.k"], dump[f"layer{i}.v"]) for i in range(n)]


def _assert_hf(dump: dict[str, torch.Tensor], model: Path, tokens: list[int]) -> None:
    ref, _ = hf_reference(model, tokens)
    assert dump["layer0.k"].shape[0] == len(tokens)
    for i, (k, v) in enumerate(ref):
        assert (dump[f"layer{i}.k"] - k).abs().max().item() <= 1e-4, f"layer {i} K"
        assert (dump[f"layer{i}.v"] - v).abs().max().item() <= 1e-4, f"layer {i} V"


@pytest.mark.forked
@pytest.mark.long(400, "a pipeline start and guided requests whose companion puts are held and refused")
def test_guided_request_end_to_end_and_failing_companion(tmp_path: Path) -> None:
    model = ensure_tiny_model()
    dump = tmp_path  # pytest's own temp dir: it keeps only its newest few runs
    gate = dump / "companion-gate"
    env = {**STAGE_ENV, COMPANION_GATE_ENV: str(gate)}
    # its logs under tmp_path: a run with a failed request keeps them (RunLogDir)
    pipe = Pipeline.from_config(
        ROOT / "stage_configs/ar_to_dit_cfg.yaml", model=str(model), env=env, log_dir=dump / "logs"
    )
    stages = [msgspec.structs.replace(s, debug_dump_dir=str(dump)) for s in pipe.plan.stages]
    stages[0] = msgspec.structs.replace(stages[0], worker_cls="pipeline_fixtures.FailCompanionWorker")
    pipe.plan = msgspec.structs.replace(pipe.plan, stages=stages)
    with pipe:
        pids = pipe.stage_pids()
        [ok] = pipe.generate(["A cute cat"], request_ids=["ok-1"])
        t0 = time.monotonic()
        [failed] = pipe.generate(["A cute dog"], request_ids=["fail-1"], raise_on_error=False)
        fail_s = time.monotonic() - t0
        # the failed request's primary KV was withdrawn at once (not left for the TTL)
        left_for_failed = [n for n in shm_segments(f"kvbridge.{pipe.run_id}") if "ifail-1" in n]
        # guidance switched off per request: no companion is computed or sent
        pipe.submit("A cute cat", request_id="plain-1", stage_params={1: {"guidance_scale": 1.0}})
        plain = []
        while not plain:
            plain = pipe.poll(0.1)
        # a guided request aborted while its companion's send is held (its primary may be
        # decoding, or finished with its send queued behind the companion's, or even seen
        # finished by the stage): once the sends go through, the LLM stage withdraws every
        # KV of the group (nobody will consume it)
        gate.touch()
        pipe.submit("A cute cat", request_id="hold-1")
        assert _pump_until(pipe, lambda: Path(f"{gate}.waiting").exists())
        assert pipe.abort("hold-1", "client went away")
        gate.unlink()
        assert _pump_until(pipe, lambda: Path(f"{gate}.done").exists())
        held_gone = _pump_until(pipe, lambda: not _segments(pipe, "ihold-1"), 30)
        # a plain request whose StageDone crossed its Abort (the orchestrator drops the late
        # StageDone): the LLM stage withdraws the KV it announced
        pipe.submit("A cute cat", request_id="cross-1", stage_params={1: {"guidance_scale": 1.0}})
        assert _wait_unread(pipe)  # the StageDone is queued, not read yet
        assert pipe.abort("cross-1", "client went away")
        crossed_gone = _pump_until(pipe, lambda: not _segments(pipe, "icross-1"), 30)
        # ... and a guided one: its group was reported (forgotten by the stage) before the
        # Abort came, and the companion's KV is withdrawn with the primary's
        pipe.submit("A cute cat", request_id="cross-2")
        assert _wait_unread(pipe)
        assert pipe.abort("cross-2", "client went away")
        crossed_group_gone = _pump_until(pipe, lambda: not _segments(pipe, "icross-2"), 30)
        crossed_group_left = _segments(pipe, "icross-2")
        [again] = pipe.generate(["A cute cat"], request_ids=["ok-2"])  # the engine still serves
        with pytest.raises(ValueError, match="reserved for CFG companions"):
            pipe.generate(["x"], request_ids=["a::cfg_neg"])
        with pytest.raises(ValueError, match=r"'hold-1' ended in error .* retry under a new id"):
            pipe.submit("x", request_id="hold-1")  # its late KV would be withdrawn

    assert held_gone, "the aborted group's KV was not withdrawn"
    assert crossed_gone, "the KV announced by a StageDone that crossed an Abort was not withdrawn"
    assert crossed_group_gone, f"a crossed guided request's KV was left: {crossed_group_left}"
    # the guided request: both caches arrived and equal transformers' past_key_values
    assert ok.error is None, ok.error
    kv_in = {t.purpose: t for t in ok.transfers if t.what == "kv" and t.side == "receiver"}
    assert set(kv_in) == {"kv", CFG_NEGATIVE} and all(t.nbytes > 0 for t in kv_in.values())
    rid = encode_request_id("ok-1")
    primary = load_dump(dump / f"stage1_{rid}_kv.safetensors")
    companion = load_dump(dump / f"stage1_{rid}_{CFG_NEGATIVE}.safetensors")
    out = ok.stages[0].output
    tokens = list(out["prompt_token_ids"]) + list(out["token_ids"])
    _assert_hf(primary, model, tokens[: primary["layer0.k"].shape[0]])
    assert len(tokens) - 1 <= primary["layer0.k"].shape[0] <= len(tokens)
    from transformers import AutoTokenizer

    neg_tokens = AutoTokenizer.from_pretrained(str(model))(NEGATIVE).input_ids
    _assert_hf(companion, model, neg_tokens)  # the companion's KV is exactly its prompt's
    assert kv_in[CFG_NEGATIVE].nbytes == len(neg_tokens) * 2 * 2 * 2 * 32 * 4
    # ... and the image is the guided one computed in-process from those two KVs
    dit = TinyKVDiT(**DIT_KWARGS, seed=0).eval()
    want = denoise(
        dit, _layers(primary), num_steps=8, seed=0, uncond_kv=_layers(companion), guidance_scale=4.0
    )
    assert torch.allclose(torch.from_numpy(ok.image), want[0], atol=1e-5)
    unguided = denoise(dit, _layers(primary), num_steps=8, seed=0)[0]
    assert not torch.allclose(torch.from_numpy(ok.image), unguided, atol=1e-3)
    assert again.error is None and torch.equal(torch.from_numpy(again.image), torch.from_numpy(ok.image))

    # a companion whose send fails: the request fails naming it, well within one deadline (30 s)
    assert failed.error is not None and failed.image is None
    assert "CFG companion 'cfg_neg' (fail-1::cfg_neg) of fail-1" in failed.error, failed.error
    assert "injected: the store refused the CFG companion" in failed.error
    assert fail_s < 15, fail_s
    assert left_for_failed == []
    assert not (dump / f"stage1_{encode_request_id('fail-1')}_kv.safetensors").exists()  # never denoised

    # guidance off for one request: one KV, the unguided image
    [p] = plain
    assert p.error is None, p.error
    assert {t.purpose for t in p.transfers if t.what == "kv"} == {"kv"}
    assert not (dump / f"stage1_{encode_request_id('plain-1')}_{CFG_NEGATIVE}.safetensors").exists()
    plain_kv = _layers(load_dump(dump / f"stage1_{encode_request_id('plain-1')}_kv.safetensors"))
    assert torch.allclose(
        torch.from_numpy(p.image), denoise(dit, plain_kv, num_steps=8, seed=0)[0], atol=1e-5
    )

    # nothing left behind
    for pid in pids.values():
        assert not descendants(pid)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert shm_segments(f"kvbridge.{pipe.run_id}") == []
