"""The tiny talker: its checkpoint, its transformers reference, its conditioning buffer and
its registration with vLLM. The model runs in a real engine, fed by the kvbridge transport,
in test_runner_conditioning_engine (one engine start for both: the suite's time budget).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_kvbridge.models.tiny_talker import (
    ARCHITECTURE,
    DEFAULT_CONDITIONING_DIM,
    ConditioningBuffer,
    ensure_tiny_talker,
    make_tiny_talker,
    reference_greedy,
)

DIM = DEFAULT_CONDITIONING_DIM
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
MAX_TOKENS = 12


def _rows(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------
# No engine
# --------------------------------------------------------------------------------------


def test_checkpoint_is_deterministic_and_names_the_talker(tmp_path: Path) -> None:
    from vllm_kvbridge.models.tiny_lm import make_tiny_model

    a, b = make_tiny_talker(tmp_path / "a", seed=0), make_tiny_talker(tmp_path / "b", seed=0)
    for f in FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURE]
    assert cfg["model_type"] == "llama"
    assert cfg["kvbridge_conditioning_dim"] == DIM
    talker = load_file(str(a / "model.safetensors"))
    assert talker["cond_proj.weight"].shape == (cfg["hidden_size"], DIM)
    # Not the thinker of the same seed, but the thinker's tokenizer.
    thinker_dir = make_tiny_model(tmp_path / "thinker", seed=0)
    thinker = load_file(str(thinker_dir / "model.safetensors"))
    assert set(talker) == set(thinker) | {"cond_proj.weight"}
    assert not torch.equal(talker["model.embed_tokens.weight"], thinker["model.embed_tokens.weight"])
    assert (a / "tokenizer.json").read_bytes() == (thinker_dir / "tokenizer.json").read_bytes()
    # Another seed, another talker; the cache returns one directory with the same files.
    other = make_tiny_talker(tmp_path / "c", seed=1)
    assert (other / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    cached = ensure_tiny_talker(seed=0, cache_dir=tmp_path / "cache")
    assert ensure_tiny_talker(seed=0, cache_dir=tmp_path / "cache") == cached
    for f in FILES:
        assert (cached / f).read_bytes() == (a / f).read_bytes(), f
    assert ensure_tiny_talker(seed=0, cache_dir=tmp_path / "cache", conditioning_dim=64) != cached


def test_reference_conditioning_matters(tmp_path: Path) -> None:
    from pipeline_fixtures import hf_greedy

    model_dir = make_tiny_talker(tmp_path / "talker", seed=0)
    prompt = [1, 40, 77, 123, 300, 9]
    zeros = reference_greedy(model_dir, torch.zeros(len(prompt), DIM), prompt, MAX_TOKENS)
    assert len(zeros) == MAX_TOKENS
    # Zero rows: cond_proj adds nothing, so it is the plain Llama underneath.
    assert zeros == hf_greedy(model_dir, prompt, MAX_TOKENS, ignore_eos=True)
    assert reference_greedy(model_dir, torch.zeros(0, DIM), prompt, MAX_TOKENS) == zeros
    assert reference_greedy(model_dir, _rows(len(prompt)), prompt, MAX_TOKENS) != zeros
    with pytest.raises(ValueError, match="rows must be"):
        reference_greedy(model_dir, torch.zeros(3, DIM + 1), prompt, 1)


def test_conditioning_buffer_writes_rows_and_zeroes_the_rest() -> None:
    buf = ConditioningBuffer(16, DIM, dtype=torch.float32)
    address = buf.rows.data_ptr()
    first = _rows(7).double()  # any float dtype: cast to the buffer's
    buf.write(first)
    assert torch.equal(buf.rows[:7], first.float()) and not buf.rows[7:].any()
    second = _rows(3, seed=8)
    buf.write(second)  # the tail of the earlier, longer write is zeroed
    assert torch.equal(buf.rows[:3], second) and not buf.rows[3:].any()
    # A (padded) forward of 5 tokens reads rows then zeros, and clears what it read.
    taken = buf.take(5).clone()
    assert torch.equal(taken[:3], second) and not taken[3:].any()
    buf.clear(5)
    assert not buf.rows.any()
    buf.write(torch.zeros(0, DIM))
    assert buf.rows.data_ptr() == address
    for bad, error in [
        (torch.zeros(3, DIM + 1), ValueError),
        (torch.zeros(DIM), ValueError),
        (torch.zeros(17, DIM), ValueError),
        (torch.zeros(3, DIM, dtype=torch.int64), TypeError),
    ]:
        with pytest.raises(error):
            buf.write(bad)
    with pytest.raises(ValueError, match="exceeds"):
        buf.take(17)
    # A buffer made under inference mode (as vLLM builds models) takes writes from outside it.
    with torch.inference_mode():
        inference_buf = ConditioningBuffer(4, DIM)
    inference_buf.write(_rows(2))
    assert inference_buf.rows[:2].any()


# --------------------------------------------------------------------------------------
# A real engine
# --------------------------------------------------------------------------------------


def test_the_entry_point_registers_the_talker_with_vllm() -> None:
    """vLLM loads ``vllm.general_plugins`` in every process it starts; the talker runs in a real
    engine (its worker process registers it this way) in test_runner_conditioning_engine,
    which also checks its tokens against :func:`reference_greedy` with and without rows."""
    import importlib.metadata

    plugins = {p.name: p for p in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins["kvbridge_models"].value == "vllm_kvbridge.models:register_vllm_models"
    plugins["kvbridge_models"].load()()
    from vllm import ModelRegistry

    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
