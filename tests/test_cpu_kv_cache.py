"""The KV cache size an LLM stage on CPU gets when its config does not choose one."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_kvbridge.config.cpu_kv_cache import CPU_KV_CACHE_CAP_BYTES, cpu_kv_cache_bytes, with_cpu_kv_cache

MIB = 1 << 20


def _config_dir(tmp_path: Path, **fields: object) -> str:
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 128,
        "max_position_embeddings": 2048,
        **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_a_stage_gets_what_a_full_batch_of_its_model_can_use(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The tiny model: 2 layers x K and V x 2 KV heads x 32 dims x float32 = 1 KiB per token;
    # vLLM's CPU default batch is 256 sequences per rank, of max_model_len tokens each.
    assert cpu_kv_cache_bytes(str(tiny_model_dir), {"max_model_len": 512}) == 128 * MIB
    assert cpu_kv_cache_bytes(str(tiny_model_dir), {"max_model_len": 512, "max_num_seqs": 8}) == 4 * MIB
    assert cpu_kv_cache_bytes(str(tiny_model_dir), {"max_model_len": 512, "dtype": "bfloat16"}) == 64 * MIB
    # TP 2: each rank holds one of the two KV heads, of twice the sequences (vLLM's default).
    assert (
        cpu_kv_cache_bytes(str(tiny_model_dir), {"max_model_len": 512}, tensor_parallel_size=2) == 128 * MIB
    )
    # No max_model_len: the model's own context length.
    model = _config_dir(tmp_path, max_position_embeddings=1024)
    assert cpu_kv_cache_bytes(model, {}) == 256 * MIB
    # An explicit head_dim wins over hidden_size / heads (as in Qwen3 or Gemma configs).
    assert cpu_kv_cache_bytes(model, {"max_num_seqs": 1}, 1) == 2 * 2 * 2 * 32 * 4 * 1024
    assert (
        cpu_kv_cache_bytes(_config_dir(tmp_path, head_dim=64), {"max_num_seqs": 1})
        == 2 * 2 * 2 * 64 * 4 * 2048
    )


def test_a_large_model_gets_at_most_one_gib_and_an_unreadable_one_gets_one_gib(tmp_path: Path) -> None:
    big = _config_dir(
        tmp_path, num_hidden_layers=32, num_key_value_heads=8, hidden_size=4096, num_attention_heads=32
    )
    assert cpu_kv_cache_bytes(big, {"max_model_len": 4096}) == CPU_KV_CACHE_CAP_BYTES
    assert cpu_kv_cache_bytes(str(tmp_path / "missing"), {"max_model_len": 512}) == CPU_KV_CACHE_CAP_BYTES


def test_a_size_the_user_chose_is_left_alone(tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    args = {"max_model_len": 512}
    assert with_cpu_kv_cache(model, args, env={})["kv_cache_memory_bytes"] == 128 * MIB
    assert args == {"max_model_len": 512}  # a copy
    # vLLM reads these themselves; the env var wins over the engine argument in vLLM.
    assert "kv_cache_memory_bytes" not in with_cpu_kv_cache(model, args, env={"VLLM_CPU_KVCACHE_SPACE": "4"})
    chosen = {**args, "gpu_memory_utilization": 0.3}
    assert "kv_cache_memory_bytes" not in with_cpu_kv_cache(model, chosen, env={})
    assert (
        with_cpu_kv_cache(model, {**args, "kv_cache_memory_bytes": 5 * MIB}, env={})["kv_cache_memory_bytes"]
        == 5 * MIB
    )
