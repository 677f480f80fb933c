"""How much host memory an LLM stage on CPU gives vLLM's KV cache.

vLLM on CPU takes the size from ``VLLM_CPU_KVCACHE_SPACE`` (GiB, which wins), from
``kv_cache_memory_bytes``, or else from ``gpu_memory_utilization`` of the whole machine's
memory (0.9 by default: a second engine on the host could not start). Stages used to get
``VLLM_CPU_KVCACHE_SPACE=1``, but the engine allocates and touches the whole cache at start:
1 GiB took about 3 s of every engine start on two cores, for a tiny model that can never
use more than 128 MiB. A stage that chooses none of the three now gets what its engine can
use at full batch (``max_num_seqs`` sequences of ``max_model_len`` tokens), at most 1 GiB.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

#: The most a stage gets without asking (what every stage got before).
CPU_KV_CACHE_CAP_BYTES = 1 << 30
#: vLLM's default ``max_num_seqs`` on CPU for its ``LLM`` class, per TP rank
#: (``EngineArgs.get_batch_defaults``, vLLM 0.32).
_CPU_DEFAULT_SEQS_PER_RANK = 256
#: Settings by which the user chose the size; vLLM reads them as they are.
_USER_SIZE_ARGS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
_HALF_DTYPES = ("float16", "half", "bfloat16", "fp16", "bf16")


def user_sized(engine_args: Mapping[str, Any], env: Mapping[str, str]) -> bool:
    """Whether the user chose the KV cache size (by env var or engine argument)."""
    return bool(env.get("VLLM_CPU_KVCACHE_SPACE")) or any(
        engine_args.get(k) is not None for k in _USER_SIZE_ARGS
    )


def cpu_kv_cache_bytes(model: str, engine_args: Mapping[str, Any], tensor_parallel_size: int = 1) -> int:
    """Bytes of KV cache one TP rank of an engine on ``model`` needs to hold ``max_num_seqs``
    sequences of ``max_model_len`` tokens, at most :data:`CPU_KV_CACHE_CAP_BYTES` (also what
    a model whose config cannot be read gets)."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model).get_text_config()
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        max_len = int(engine_args.get("max_model_len") or config.max_position_embeddings)
    except Exception as e:  # any unreadable config falls back to the cap
        logger.info("KV cache of %s: config unreadable (%s): %d bytes", model, e, CPU_KV_CACHE_CAP_BYTES)
        return CPU_KV_CACHE_CAP_BYTES
    tp = max(1, tensor_parallel_size)
    dtype_bytes = 2 if str(engine_args.get("dtype", "")).lower() in _HALF_DTYPES else 4
    per_token = layers * 2 * -(-kv_heads // tp) * head_dim * dtype_bytes
    seqs = int(engine_args.get("max_num_seqs") or _CPU_DEFAULT_SEQS_PER_RANK * tp)
    return min(CPU_KV_CACHE_CAP_BYTES, per_token * max_len * seqs)


def with_cpu_kv_cache(
    model: str,
    engine_args: Mapping[str, Any],
    tensor_parallel_size: int = 1,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``engine_args`` with ``kv_cache_memory_bytes`` set by :func:`cpu_kv_cache_bytes`,
    unless the user chose the size. For engines on CPU only: a GPU engine sizes its cache
    from the device's free memory."""
    args = dict(engine_args)
    if not user_sized(args, os.environ if env is None else env):
        args["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model, args, tensor_parallel_size)
        logger.info(
            "KV cache on CPU: kv_cache_memory_bytes=%d (%s at full batch, at most 1 GiB; set "
            "kv_cache_memory_bytes or VLLM_CPU_KVCACHE_SPACE to choose)",
            args["kv_cache_memory_bytes"],
            model,
        )
    return args
