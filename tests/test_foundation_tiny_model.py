"""The offline tiny model: deterministic, valid, loadable by transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_kvbridge.models.tiny_lm import ARCHS, TinyLMSpec, ensure_tiny_model, make_tiny_model

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_kvbridge.cli.main", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_same_seed_gives_byte_identical_files(tmp_path: Path) -> None:
    for name in ("a", "b"):
        proc = _cli("make-tiny-model", str(tmp_path / name), "--seed", "1")
        assert proc.returncode == 0, proc.stderr
        assert "wrote tiny LlamaForCausalLM model" in proc.stdout
    for f in FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_different_seed_gives_different_weights(tmp_path: Path) -> None:
    make_tiny_model(tmp_path / "s1", seed=1)
    make_tiny_model(tmp_path / "s2", seed=2)
    assert (tmp_path / "s1" / "model.safetensors").read_bytes() != (
        tmp_path / "s2" / "model.safetensors"
    ).read_bytes()


def test_config_has_gqa_and_requested_shape(tmp_path: Path) -> None:
    make_tiny_model(tmp_path, layers=3, hidden=256, heads=8, kv_heads=2, vocab=300)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3
    assert cfg["num_attention_heads"] == 8
    assert cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 32
    assert cfg["vocab_size"] == 300


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden": 130}, "multiple of heads"),
        ({"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
        ({"hidden": 64, "heads": 4}, "head_dim"),
        ({"vocab": 100}, "vocab must be"),
        ({"layers": 0}, "positive"),
    ],
)
def test_invalid_shapes_are_refused(tmp_path: Path, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path, **overrides)
    assert not (tmp_path / "model.safetensors").exists()


def test_cli_reports_invalid_shape_as_error(tmp_path: Path) -> None:
    proc = _cli("make-tiny-model", str(tmp_path / "m"), "--hidden", "130")
    assert proc.returncode != 0
    assert "multiple of heads" in proc.stderr


def test_spec_validate_accepts_defaults() -> None:
    TinyLMSpec().validate()


def test_ensure_tiny_model_builds_once(tmp_path: Path) -> None:
    first = ensure_tiny_model(seed=3, cache_dir=tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    second = ensure_tiny_model(seed=3, cache_dir=tmp_path)
    assert first == second
    assert (second / "model.safetensors").stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama-seed3"]


def test_tokenizer_and_weights_load_in_transformers(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("A cute cat").input_ids
    assert ids[0] == 1, "a Llama tokenizer starts with <s>"
    assert tok.decode(ids, skip_special_tokens=True) == "A cute cat"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_arch_is_byte_identical_per_seed_and_loads_in_transformers(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    a = make_tiny_model(tmp_path / "a", arch=arch, seed=5)
    b = make_tiny_model(tmp_path / "b", arch=arch, seed=5)
    for f in FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), (arch, f)
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == [ARCHS[arch].architecture]
    assert (cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 32)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    assert type(model).__name__ == ARCHS[arch].architecture
    logits = model(torch.tensor([[1, 40, 41, 42]])).logits
    assert logits.shape == (1, 4, 512) and torch.isfinite(logits).all()
    window = TinyLMSpec(arch=arch).sliding_window
    if window is not None:  # sliding layers and full ones: vLLM keeps two KV cache groups
        assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
        assert cfg["sliding_window"] == window


def test_an_unknown_arch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch 'gpt5'"):
        make_tiny_model(tmp_path, arch="gpt5")
    proc = _cli("make-tiny-model", str(tmp_path / "m"), "--arch", "gpt5")
    assert proc.returncode != 0 and "invalid choice" in proc.stderr
