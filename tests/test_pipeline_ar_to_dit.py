"""AR -> DiT end to end with real stage processes (one vLLM engine + the diffusion runner).

One pipeline run per shipped config (engine starts are slow), each checking several things.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from pipeline_fixtures import (
    ROOT,
    descendants,
    hf_reference,
    load_dump,
    processes_using,
    shm_segments,
)

from vllm_kvbridge.connectors.keys import encode_request_id
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.runner.diffusion_runner import denoise

DIT_KWARGS = {
    "image_size": 32,
    "patch_size": 4,
    "hidden": 64,
    "depth": 2,
    "kv_heads": 2,
    "kv_head_dim": 32,
    "seed": 0,
}
pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _expected_image(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return denoise(TinyKVDiT(**DIT_KWARGS).eval(), kv, num_steps=8, seed=0)[0]


@pytest.mark.forked
@pytest.mark.long(300, "a pipeline start (vLLM engine + DiT) and 20 requests, batched and one by one")
def test_ar_to_dit_shm_end_to_end(tmp_path: Path) -> None:
    model = ensure_tiny_model()
    dump = tmp_path
    prompts = ["A cute cat", "The quick brown fox jumps over the lazy dog. " * 3]
    lines: list[str] = []
    pipe = Pipeline.from_config(
        ROOT / "stage_configs/ar_to_dit_shm.yaml",
        model=str(model),
        progress=lines.append,
        log_dir=dump / "logs",
    )
    import msgspec

    pipe.plan = msgspec.structs.replace(
        pipe.plan, stages=[msgspec.structs.replace(s, debug_dump_dir=str(dump)) for s in pipe.plan.stages]
    )
    with pipe:
        pids = pipe.stage_pids()
        results = pipe.generate(prompts)
        # a second batch through the same running stages (several requests in flight again)
        again = pipe.generate(prompts[:1])
        # 8 prompts of different lengths at once (the DiT stage batches them:
        # max_batch_size 8), then the same 8 one at a time
        eight = [f"prompt {i}: " + "a red cube on a table " * i for i in range(8)]
        t0 = time.monotonic()
        concurrent = pipe.generate(eight)
        t_concurrent = time.monotonic() - t0
        serial = [pipe.generate([p])[0] for p in eight]
        t_serial = time.monotonic() - t0 - t_concurrent
    assert any("ready in" in line for line in lines) and any("req-1 done" in line for line in lines)
    # The LLM stage's KV cache: what 256 sequences of 512 tokens of the tiny model take
    # (config/cpu_kv_cache.py), not a fixed GiB: said in the stage's log, given to vLLM.
    log = (dump / "logs/stage_0.log").read_text(errors="replace")
    assert f"KV cache on CPU: kv_cache_memory_bytes={128 << 20} " in log
    assert f"'kv_cache_memory_bytes': {128 << 20}," in log  # vLLM's line of the arguments it got
    for r in [*results, *again]:
        assert r.error is None and r.image.shape == (3, 32, 32)
        assert bool(torch.isfinite(torch.from_numpy(r.image)).all())
        assert r.image.min() >= 0.0 and r.image.max() <= 1.0
        kv_edges = [t for t in r.transfers if t.what == "kv"]
        assert kv_edges and kv_edges[0].nbytes > 0
    assert not torch.equal(torch.from_numpy(results[0].image), torch.from_numpy(results[1].image))
    assert torch.equal(torch.from_numpy(results[0].image), torch.from_numpy(again[0].image))

    for r in results:
        out = r.stages[0].output
        tokens = list(out["prompt_token_ids"]) + list(out["token_ids"])
        dumped = load_dump(dump / f"stage1_{encode_request_id(r.request_id)}_kv.safetensors")
        seq = dumped["layer0.k"].shape[0]
        assert len(tokens) - 1 <= seq <= len(tokens)
        ref, _ = hf_reference(model, tokens[:seq])
        for i, (k, v) in enumerate(ref):
            assert (dumped[f"layer{i}.k"] - k).abs().max().item() <= 1e-4, f"layer {i} K"
            assert (dumped[f"layer{i}.v"] - v).abs().max().item() <= 1e-4, f"layer {i} V"
        kv = [(dumped[f"layer{i}.k"], dumped[f"layer{i}.v"]) for i in range(len(ref))]
        assert torch.allclose(torch.from_numpy(r.image), _expected_image(kv), atol=1e-5)

    # Batched in the DiT stage or not, each request paints the image of its own KV.
    sizes = [r.stages[1].output["batch_size"] for r in concurrent]
    print(f"\n8 concurrent: {t_concurrent:.1f} s (DiT batches {sizes}); 8 serial: {t_serial:.1f} s")
    assert max(sizes) > 1 and all(r.stages[1].output["batch_size"] == 1 for r in serial)
    worst, same_kv = 0.0, 0
    for c, s in zip(concurrent, serial):
        assert c.error is None and s.error is None
        kv_c, kv_s = (
            load_dump(dump / f"stage1_{encode_request_id(r.request_id)}_kv.safetensors") for r in (c, s)
        )
        layers = len([k for k in kv_c if k.endswith(".k")])
        kv = [(kv_c[f"layer{i}.k"], kv_c[f"layer{i}.v"]) for i in range(layers)]
        img_c, img_s = torch.from_numpy(c.image), torch.from_numpy(s.image)
        assert torch.allclose(img_c, _expected_image(kv), atol=1e-5)
        if all(torch.equal(kv_c[k], kv_s[k]) for k in kv_c):  # the LLM stage computed the same KV
            assert torch.equal(img_c, img_s)
            same_kv += 1
        worst = max(worst, (img_c - img_s).abs().max().item())
    # vLLM's KV of a prompt batched with others may differ in the last bits from its KV alone
    print(f"max |concurrent - serial| over the 8 images: {worst:.3g} ({same_kv} of 8 with the same KV)")
    assert worst <= 1e-4
    # nothing left behind
    for pid in pids.values():
        assert not descendants(pid)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert shm_segments(f"kvbridge.{pipe.run_id}") == []


def _run_cli(out_dir: Path, *args: str, prompt: str = "A cute cat") -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "run", "--stage-config"]
    argv += [str(ROOT / "stage_configs/ar_to_dit_shm.yaml"), "--prompt", prompt]
    argv += ["--output-dir", str(out_dir), "--debug-dump-dir", str(out_dir / "dump"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=280)


def _check_image_of_its_kv(out_dir: Path, heads: int, head_dim: int) -> list[int]:
    """The run wrote one PNG, painted by a DiT of the sender's geometry from the KV it got;
    returns the tokens each layer's KV held."""
    req = json.loads((out_dir / "result.json").read_text())["requests"][0]
    assert req["error"] is None and req["image_shape"] == [3, 32, 32]
    png = Path(req["outputs"][0]).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    dumped = load_dump(out_dir / "dump" / f"stage1_{encode_request_id('req-1')}_kv.safetensors")
    layers = len([k for k in dumped if k.endswith(".k")])
    kv = [(dumped[f"layer{i}.k"], dumped[f"layer{i}.v"]) for i in range(layers)]
    assert all(tuple(k.shape[1:]) == (heads, head_dim) for k, _ in kv)
    import numpy as np

    from vllm_kvbridge.pipeline.images import encode_png

    dit = TinyKVDiT(**{**DIT_KWARGS, "kv_heads": heads, "kv_head_dim": head_dim}).eval()
    assert png == encode_png(np.asarray(denoise(dit, kv, num_steps=8, seed=0)[0]))
    return [int(k.shape[0]) for k, _ in kv]


@pytest.mark.forked
@pytest.mark.long(300, "`run` through the CLI: a pipeline start (vLLM engine + DiT)")
def test_run_with_arch_qwen3(tmp_path: Path) -> None:
    """Issue 39, item 5: `run --arch qwen3` runs the LLM stage on the tiny Qwen3, and the DiT
    (its kwargs name no KV geometry) takes the geometry from it."""
    out_dir = tmp_path / "out"
    proc = _run_cli(out_dir, "--arch", "qwen3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "model: tiny offline Qwen3 (kvbridge://tiny-qwen3) at " in proc.stdout
    assert str(ensure_tiny_model(arch="qwen3")) in proc.stdout
    _check_image_of_its_kv(out_dir, heads=2, head_dim=32)
    assert processes_using(out_dir) == []


@pytest.mark.forked
@pytest.mark.long(300, "`run` through the CLI: a pipeline start (vLLM engine + DiT)")
def test_run_adapts_the_dit_to_a_model_of_other_geometry_and_sliding_windows(tmp_path: Path) -> None:
    """Issue 39, items 3 and 4: the same shipped config runs a Gemma 3 with 4 KV heads of 64
    (the tiny Llama has 2 of 32) without editing the DiT's kwargs, and its sliding-window
    layer sends only its window (vLLM's hybrid allocator on), the full layer every token."""
    from vllm_kvbridge.models.tiny_lm import TINY_SLIDING_WINDOW, make_tiny_model

    model = make_tiny_model(tmp_path / "gemma3-4x64", arch="gemma3", kv_heads=4, heads=8, hidden=512)
    out_dir = tmp_path / "out"
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # longer than the window
    proc = _run_cli(out_dir, "--model", str(model), prompt=prompt)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sliding, full = _check_image_of_its_kv(out_dir, heads=4, head_dim=64)
    assert full > TINY_SLIDING_WINDOW and sliding == TINY_SLIDING_WINDOW - 1, (sliding, full)
    assert processes_using(out_dir) == []


@pytest.mark.forked
@pytest.mark.long(300, "`run` through the CLI: a pipeline start (vLLM engine + two DiT replicas)")
def test_dit_replicas_share_concurrent_requests_over_zmq_through_the_cli(tmp_path: Path) -> None:
    """Issue 41: ar_to_dit_zmq.yaml (the cross-host transport, on loopback) with ``replicas: 2``
    on the DiT, 4 requests at once through `run`: each DiT replica is its own process, both
    serve requests (result.json says which served each), each pulls its requests' KV over
    TCP from the LLM stage, and every PNG holds the image the single-replica DiT paints for
    the same KV and seed (recomputed from the KV it received: the DiT is deterministic in
    them); the run prints each edge's connector and rate.

    The DiT denoises one request at a time here (max_batch_size 1, so each image is exactly
    the unbatched one) in 48 steps: a request takes it 0.5-2 s on this machine, while the
    LLM stage finishes the 4 within a few ms of each other (seen: 2 ms), so the next ones
    reach the DiT while replica 0 holds the first and least-outstanding routing sends them
    to replica 1 (seen: replicas 0, 1, 0, 1).

    (The ZMQ run of one request and the shared-memory run of two replicas were two tests
    of a pipeline start each; shared memory with DiT replicas is test_serve_replicas's.)"""
    import numpy as np
    import yaml

    from vllm_kvbridge.pipeline.images import encode_png

    steps = 48
    config = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_zmq.yaml").read_text())
    dit = config["stages"][1]
    dit["replicas"] = 2
    dit["diffusion"].update(max_batch_size=1, num_steps=steps)
    path = tmp_path / "ar_to_dit_zmq_replicas.yaml"
    path.write_text(yaml.safe_dump(config))
    out_dir = tmp_path / "out"
    prompts = [f"A cute cat number {i}" for i in range(4)]
    argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "run", "--stage-config", str(path)]
    for p in prompts:
        argv += ["--prompt", p]
    argv += ["--model", str(ensure_tiny_model())]
    argv += ["--output-dir", str(out_dir), "--debug-dump-dir", str(out_dir / "dump")]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert time.monotonic() - t0 < 240
    assert "[stage 0 (llm_ar)] ready in" in proc.stdout
    assert "0 -> 1 kv" in proc.stdout and "GB/s" in proc.stdout
    assert "edge 0 -> 1: ZmqConnector" in proc.stdout
    # two DiT processes, each with its own log
    for k in (0, 1):
        assert f"[stage 1 (diffusion) replica {k}] ready in" in proc.stdout
        assert (out_dir / "logs" / f"stage_1.replica{k}.log").exists()
    starts = [line for line in proc.stdout.splitlines() if "starting (pid" in line]
    pids = {line.split("(pid ")[1].split(",")[0] for line in starts}
    assert len(pids) == 3, proc.stdout  # the LLM stage and the two DiT replicas
    reqs = json.loads((out_dir / "result.json").read_text())["requests"]
    assert [r["request_id"] for r in reqs] == [f"req-{i + 1}" for i in range(4)]
    served = [next(s["replica"] for s in r["stages"] if s["stage_id"] == 1) for r in reqs]
    print(f"\nDiT replica per request: {served}")
    assert sorted(set(served)) == [0, 1], served
    assert all(r["stages"][0]["replica"] == 0 for r in reqs)  # the LLM stage has one
    model = TinyKVDiT(**DIT_KWARGS).eval()
    for r in reqs:
        assert r["error"] is None and r["image_shape"] == [3, 32, 32]
        assert f"[stage 1 (diffusion) replica {served[reqs.index(r)]}] {r['request_id']} done" in proc.stdout
        # the connector each transfer used and the node each stage ran on (the local backend's)
        [kv_edge] = r["transfers"]
        assert (kv_edge["what"], kv_edge["connector"]) == ("kv", "ZmqConnector") and kv_edge["bytes"] > 0
        assert [s["node_id"] for s in r["stages"]] == ["local", "local"]
        dumped = load_dump(out_dir / "dump" / f"stage1_{encode_request_id(r['request_id'])}_kv.safetensors")
        layers = len([k for k in dumped if k.endswith(".k")])
        kv = [(dumped[f"layer{i}.k"], dumped[f"layer{i}.v"]) for i in range(layers)]
        png = Path(r["outputs"][0]).read_bytes()
        assert png == encode_png(np.asarray(denoise(model, kv, num_steps=steps, seed=0)[0])), r["request_id"]
