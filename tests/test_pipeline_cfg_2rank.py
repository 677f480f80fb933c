"""A 2-rank diffusion stage (CFG-parallel over gloo) behind a real vLLM engine, through the CLI.

``vllm-kvbridge run`` on the shipped ``stage_configs/ar_to_dit_cfg_2rank.yaml``: rank 0 (the
stage process) receives the primary and companion KV over shared memory and distributes them
to rank 1 (its own process), each rank computes one guidance branch per step. The images
must equal the single-rank guided denoise of the consumed KVs (the rank-level bit-exactness
with equal thread counts is tests/test_dit_cfg.py; here the ranks run with the stage's
thread count and the PNG is 8-bit, so the stated tolerance is one 8-bit level).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from pipeline_fixtures import ROOT, hf_reference, load_dump, processes_using, run_names

from vllm_kvbridge.connectors.keys import encode_request_id
from vllm_kvbridge.models.guidance import CFG_NEGATIVE
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.runner.diffusion_runner import denoise

pytestmark = [pytest.mark.engine, pytest.mark.slow]

DIT_KWARGS = {"image_size": 32, "patch_size": 4, "hidden": 64, "depth": 2, "kv_heads": 2, "kv_head_dim": 32}


def _png_pixels(png: bytes) -> np.ndarray:
    """Decode the CLI's PNG (8-bit RGB, filter 0 on every row) to ``[H, W, 3]`` uint8."""
    pos, idat, size = 8, b"", None
    while pos < len(png):
        n = int.from_bytes(png[pos : pos + 4], "big")
        tag, data = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + n]
        if tag == b"IHDR":
            size = (int.from_bytes(data[4:8], "big"), int.from_bytes(data[:4], "big"))
        elif tag == b"IDAT":
            idat += data
        pos += 12 + n
    assert size is not None
    h, w = size
    rows = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(h, w, 3)


def _layers(dump: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    n = len([k for k in dump if k.endswith(".k")])
    return [(dump[f"layer{i}.k"], dump[f"layer{i}.v"]) for i in range(n)]


@pytest.mark.forked
@pytest.mark.long(400, "`run` through the CLI: a vLLM engine and a 2-rank DiT stage")
def test_two_rank_dit_same_image_as_one_rank_nothing_left_behind(tmp_path: Path) -> None:
    model = ensure_tiny_model()
    out_dir = tmp_path  # pytest's own temp dir: it keeps only its newest few runs
    prompts = ["A cute cat", "The quick brown fox jumps over the lazy dog"]
    cmd = [sys.executable, "-m", "vllm_kvbridge.cli.main", "run"]
    cmd += ["--stage-config", str(ROOT / "stage_configs/ar_to_dit_cfg_2rank.yaml"), "--model", str(model)]
    cmd += ["--output-dir", str(out_dir), "--debug-dump-dir", str(out_dir / "dump")]
    for p in prompts:
        cmd += ["--prompt", p]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 -> 1 kv cfg_neg" in proc.stdout  # the summary lists the companion's edge row
    result = json.loads((out_dir / "result.json").read_text())
    dit = TinyKVDiT(**DIT_KWARGS, seed=0).eval()
    for req in result["requests"]:
        assert req["error"] is None and req["image_shape"] == [3, 32, 32]
        kv_rows = {t["purpose"]: t for t in req["transfers"] if t["what"] == "kv"}
        assert set(kv_rows) == {"kv", CFG_NEGATIVE} and all(t["bytes"] > 0 for t in kv_rows.values())
        rid = encode_request_id(req["request_id"])
        primary = load_dump(out_dir / "dump" / f"stage1_{rid}_kv.safetensors")
        companion = load_dump(out_dir / "dump" / f"stage1_{rid}_{CFG_NEGATIVE}.safetensors")
        # the companion is the negative prompt's KV (transformers' past_key_values)
        from transformers import AutoTokenizer

        neg = AutoTokenizer.from_pretrained(str(model))("blurry, low quality").input_ids
        ref, _ = hf_reference(model, neg)
        for i, (k, v) in enumerate(ref):
            assert (companion[f"layer{i}.k"] - k).abs().max().item() <= 1e-4
            assert (companion[f"layer{i}.v"] - v).abs().max().item() <= 1e-4
        one_rank = denoise(
            dit, _layers(primary), num_steps=8, seed=0, uncond_kv=_layers(companion), guidance_scale=4.0
        )[0]
        want = (one_rank.clamp(0, 1) * 255 + 0.5).to(torch.uint8).permute(1, 2, 0).numpy()
        got = _png_pixels(Path(req["outputs"][0]).read_bytes())
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    # rank 1 served both requests and stopped when told; every process and segment is gone
    log = (out_dir / "logs" / "stage_1.log").read_text()
    assert "[stage 1 rank 1] stopped after 2 request(s)" in log, log[-2000:]
    assert processes_using(out_dir) == []  # rank 1 wrote into the stage's log too
    assert run_names(result["run_id"]) == set()  # this run's: others on the host do not count
