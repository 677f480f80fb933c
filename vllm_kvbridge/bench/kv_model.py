"""The KV-heavy random-weight model of the engine benchmarks (``ar-overhead``, ``kv-path``).

Its KV cache is shaped like a real 7B-class model's (Qwen2.5-7B: 28 layers, 4 KV heads,
head_dim 128; 112 KiB per token in float32) while the rest stays small (hidden 512 =
4 heads x 128, MLP 512), so prefill and decode are cheap on a CPU and the KV dominates
what a kvbridge stage moves. Built once into the cache dir
(:func:`~vllm_kvbridge.models.tiny_lm.build_once`), like the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_kvbridge.models.tiny_lm import TinyLMSpec, build_once, default_cache_dir, make_tiny_model

#: Layers, KV heads and head_dim of the KV a 7B-class model sends.
LAYERS, KV_HEADS, HEAD_DIM = 28, 4, 128


def kv_heavy_spec(layers: int = LAYERS, max_position: int = 16384) -> TinyLMSpec:
    """28 layers x 4 KV heads x head_dim 128 (``hidden = heads * head_dim = 512``)."""
    return TinyLMSpec(
        seed=0,
        layers=layers,
        hidden=KV_HEADS * HEAD_DIM,
        heads=KV_HEADS,
        kv_heads=KV_HEADS,
        vocab=512,
        intermediate=512,
        max_position=max_position,
    )


def ensure_kv_heavy_model(
    layers: int = LAYERS, max_position: int = 16384, cache_dir: str | Path | None = None
) -> Path:
    """The KV-heavy model directory, built once under ``cache_dir`` (default: the kvbridge
    cache dir, ``$VLLM_KVBRIDGE_CACHE`` or ~/.cache/vllm-kvbridge)."""
    spec = kv_heavy_spec(layers, max_position)
    target = Path(cache_dir or default_cache_dir()) / f"kv-heavy-llama-l{layers}-p{max_position}"
    return build_once(target, lambda tmp: make_tiny_model(tmp, spec))


def kv_bytes(tokens: int, layers: int = LAYERS, dtype: str | torch.dtype = "float32") -> int:
    """Bytes of the K and V of ``tokens`` tokens of this model in ``dtype``."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * KV_HEADS * HEAD_DIM * tokens * itemsize


def model_layers(model_dir: str | Path) -> int:
    """``num_hidden_layers`` of a model directory's config."""
    import json

    return int(json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"])


__all__ = [
    "HEAD_DIM",
    "KV_HEADS",
    "LAYERS",
    "ensure_kv_heavy_model",
    "kv_bytes",
    "kv_heavy_spec",
    "model_layers",
]


def cpu_kv_cache_args(gib: int) -> dict[str, int]:
    """Engine arguments that give a bench engine ``gib`` GiB of KV cache on CPU (none on GPU,
    where vLLM sizes it from the device). An argument, not ``VLLM_CPU_KVCACHE_SPACE``: a
    bench run inside another process (a test) must not change the KV cache of every engine
    that process starts later (the variable wins over any stage's own size)."""
    from vllm.platforms import current_platform

    return {"kv_cache_memory_bytes": gib << 30} if current_platform.is_cpu() else {}
