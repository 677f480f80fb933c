"""AR -> DiT over NIXL (``stage_configs/ar_to_dit_nixl.yaml``).

Real stage processes (one vLLM engine + the diffusion runner), real NIXL agents (UCX over
cma/tcp on loopback) at both ends of the edge: the KV the DiT consumed is transformers' KV
of the same tokens, and the stages leave no process behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec
import pytest
import torch
from pipeline_fixtures import ROOT, check_dumped_kv_is_transformers_kv, descendants

from vllm_kvbridge.models.tiny_llama import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline

CONFIG = ROOT / "stage_configs/ar_to_dit_nixl.yaml"
DIT_KWARGS = {"image_size": 32, "patch_size": 4, "hidden": 64, "depth": 2, "kv_heads": 2, "kv_head_dim": 32}


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.forked
@pytest.mark.timeout(300)
def test_ar_to_dit_over_nixl() -> None:
    model = ensure_tiny_model()
    dump = Path(tempfile.mkdtemp(prefix="kvb-dump-nixl-"))
    prompts = ["A cute cat", "The quick brown fox jumps over the lazy dog. " * 3]
    pipe = Pipeline.from_config(CONFIG, model=str(model))
    pipe.plan = msgspec.structs.replace(
        pipe.plan, stages=[msgspec.structs.replace(s, debug_dump_dir=str(dump)) for s in pipe.plan.stages]
    )
    ends = {e.role: e.connector for s in pipe.plan.stages for e in (*s.inputs, *s.outputs)}
    assert {c.name for c in ends.values()} == {"NixlConnector"}
    assert ends["sender"].config["ucx_tls"] == "cma,tcp"
    with pipe:
        pids = pipe.stage_pids()
        results = pipe.generate(prompts)
    for r in results:
        assert r.error is None and r.image.shape == (3, 32, 32)
        kv = [t for t in r.transfers if t.what == "kv"]
        assert kv and all(t.nbytes > 0 for t in kv)
        check_dumped_kv_is_transformers_kv(model, r, dump, {**DIT_KWARGS, "seed": 0})
    assert not torch.equal(torch.from_numpy(results[0].image), torch.from_numpy(results[1].image))
    for pid in pids.values():
        assert not descendants(pid)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
