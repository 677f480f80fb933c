"""The :class:`~vllm_kvbridge.kv.layout.KVCacheLayout` of the caches vLLM hands out, built
from vLLM's own description of them (attention backend, KV cache spec, kernel block size),
never guessed from a tensor's shape, and the KV cache groups the layers live in
(:func:`kv_cache_groups`: vLLM's hybrid allocator keeps full-attention and sliding-window
layers in separate groups, each with its own block table). Reading and writing the
caches stays in :mod:`vllm_kvbridge.kv.paged`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvbridge.kv.layout import (
    KVCacheLayout,
    KVLayoutError,
    cpu_layout,
    packed_layout,
)

__all__ = [
    "KVCacheGroup",
    "kv_cache_groups",
    "layout_for_backend",
    "layout_from_kv_cache_config",
    "layout_from_vllm",
]

#: Backend names whose K/V sit packed in C (non-MLA, non-quantized attention).
_PACKED_BACKENDS = frozenset(
    {
        "FLASH_ATTN",
        "FLASHINFER",
        "TRITON_ATTN",
        "FLEX_ATTENTION",
        "ROCM_ATTN",
        "ROCM_AITER_FA",
        "ROCM_AITER_UNIFIED_ATTN",
        "TRITON_FLASH_ATTN",
        "TRITON_FLASHINFER",
    }
)
_CPU_BACKENDS = frozenset({"CPU_ATTN"})


def _backend_name(backend: Any) -> str:
    if isinstance(backend, str):
        return backend.upper()
    get_name = getattr(backend, "get_name", None)
    if callable(get_name):
        return str(get_name()).upper()
    raise KVLayoutError(f"cannot tell the attention backend from {backend!r}")


def layout_for_backend(
    backend: Any,
    kv_cache_spec: Any,
    *,
    kv_cache_layout: Any = None,
    cache_dtype: str = "auto",
    model_dtype: torch.dtype | None = None,
    kernel_block_size: int | None = None,
) -> KVCacheLayout:
    """Build the layout from a vLLM attention backend (class or name) and its KV cache spec.

    ``kv_cache_spec`` is a vLLM ``AttentionSpec`` (``FullAttentionSpec`` ...): its
    ``num_kv_heads``, ``head_size``, ``head_size_v``, ``block_size`` and ``dtype`` are used.
    ``kv_cache_layout`` is vLLM's resolved ``KVCacheLayout`` (enum or name). On CPU the
    kernel ISA is chosen the way the backend chooses it (``cpu_attn._get_attn_isa``),
    from ``model_dtype`` (the model's dtype, which the backend uses, not the cache's).
    Refuses quantized caches, MLA and non-attention specs with :class:`KVLayoutError`.
    """
    name = _backend_name(backend)
    if cache_dtype not in ("auto", None) and not str(cache_dtype).startswith(("float", "bfloat", "half")):
        raise KVLayoutError(f"quantized KV caches ({cache_dtype!r}) are not supported")
    if getattr(kv_cache_spec, "kv_quant_mode", 0):
        raise KVLayoutError(f"quantized KV caches ({kv_cache_spec.kv_quant_mode!r}) are not supported")
    try:
        num_kv_heads = int(kv_cache_spec.num_kv_heads)
        head_size = int(kv_cache_spec.head_size)
        head_size_v = int(getattr(kv_cache_spec, "head_size_v", None) or head_size)
        block_size = int(kv_cache_spec.block_size)
        dtype = kv_cache_spec.dtype
    except AttributeError as exc:
        kind = type(kv_cache_spec).__name__
        raise KVLayoutError(f"{kind} is not an attention KV cache spec: {exc}") from exc
    if getattr(kv_cache_spec, "num_head_slots", None) not in (None, num_kv_heads):
        raise KVLayoutError("KV cache specs with packed head slots are not supported")
    if getattr(kv_cache_spec, "state_content_bytes", None) is not None:
        raise KVLayoutError("KV cache specs with packed state content are not supported")
    order = "LBHNC"
    if kv_cache_layout is not None:
        order = getattr(kv_cache_layout, "name", None) or str(kv_cache_layout)
    blocks_per_block = 1
    tensor_block_size = block_size
    if kernel_block_size is not None and kernel_block_size != block_size:
        if block_size % kernel_block_size:
            raise KVLayoutError(f"kernel block size {kernel_block_size} does not divide {block_size}")
        blocks_per_block = block_size // kernel_block_size
        tensor_block_size = kernel_block_size
    if name in _CPU_BACKENDS:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(model_dtype or dtype, tensor_block_size, head_size, cache_dtype or "auto")
        layout = cpu_layout(num_kv_heads, head_size, tensor_block_size, dtype, isa=isa)
        if blocks_per_block != 1:
            raise KVLayoutError("the CPU backend does not split blocks into kernel blocks")
        return layout
    if name in _PACKED_BACKENDS:
        return packed_layout(
            num_kv_heads,
            head_size,
            tensor_block_size,
            dtype,
            head_size_v=head_size_v,
            physical_order=order,
            backend=name,
            blocks_per_block=blocks_per_block,
        )
    raise KVLayoutError(
        f"attention backend {name!r} is not supported (CPU: {sorted(_CPU_BACKENDS)}, "
        f"GPU: {sorted(_PACKED_BACKENDS)})"
    )


def layout_from_vllm(model_runner: Any, kv_cache_group_id: int = 0) -> KVCacheLayout:
    """The layout of a live vLLM v1 model runner's ``kv_caches`` (after KV cache init).

    Reads ``runner.attn_groups[group][0]`` (backend, spec, kernel block size),
    ``runner.kv_cache_config.kv_cache_layout`` and ``runner.cache_config.cache_dtype``.
    """
    try:
        attn_group = model_runner.attn_groups[kv_cache_group_id][0]
    except (AttributeError, IndexError) as exc:
        raise KVLayoutError(f"model runner has no attention group {kv_cache_group_id} yet: {exc}") from exc
    kv_cache_config = getattr(model_runner, "kv_cache_config", None)
    order = getattr(kv_cache_config, "kv_cache_layout", None)
    cache_dtype = getattr(getattr(model_runner, "cache_config", None), "cache_dtype", "auto")
    model_dtype = getattr(getattr(model_runner, "model_config", None), "dtype", None)
    return layout_for_backend(
        attn_group.backend,
        attn_group.kv_cache_spec,
        kv_cache_layout=order,
        cache_dtype=cache_dtype,
        model_dtype=model_dtype,
        kernel_block_size=attn_group.kernel_block_size,
    )


def layout_from_kv_cache_config(
    vllm_config: Any, kv_cache_config: Any, kv_cache_group_id: int = 0
) -> KVCacheLayout:
    """The layout of the caches vLLM registers with a KV connector (``register_kv_caches``).

    What a connector sees, with no model runner: the attention backend of the group's
    layers (vLLM's ``get_current_attn_backends``, which any runner's layers answer), the
    group's KV cache spec and the kernel block size vLLM picks for them
    (``select_common_block_size``, as ``prepare_kernel_block_sizes`` does).
    """
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.worker.utils import select_common_block_size

    try:
        group = kv_cache_config.kv_cache_groups[kv_cache_group_id]
    except (AttributeError, IndexError) as exc:
        raise KVLayoutError(f"KV cache config has no group {kv_cache_group_id}: {exc}") from exc
    spec = _group_spec(group)
    backend = get_current_attn_backends(vllm_config, list(group.layer_names))[0]
    kernel_block_size = spec.block_size
    # Block-outermost packing puts other layers' pages between the blocks: never split.
    outermost = any(
        getattr(t, "block_stride", 0) > getattr(t, "layer_stride", 0)
        for t in getattr(kv_cache_config, "kv_cache_tensors", ())
        if not set(getattr(t, "layers", ())).isdisjoint(group.layer_names)
    )
    if getattr(spec, "has_layer_views", False) and not outermost:
        kernel_block_size = select_common_block_size(spec.block_size, [backend], [spec])
    return layout_for_backend(
        backend,
        spec,
        kv_cache_layout=getattr(kv_cache_config, "kv_cache_layout", None),
        cache_dtype=vllm_config.cache_config.cache_dtype,
        model_dtype=vllm_config.model_config.dtype,
        kernel_block_size=kernel_block_size,
    )


@dataclass(frozen=True)
class KVCacheGroup:
    """One of vLLM's KV cache groups as kvbridge sends it: its layers (model layer indices)
    and the sliding window of its layers (None: full attention, the whole sequence)."""

    layers: tuple[int, ...]
    window: int | None = None

    def first_kept(self, num_tokens: int) -> int:
        """The first token this group's blocks still hold once ``num_tokens`` are computed.

        A sliding layer attends to its last ``window`` tokens, the next one included, so it
        keeps ``window - 1``; vLLM frees the blocks wholly before them (its
        ``SlidingWindowManager.get_num_skipped_tokens``), and transformers' sliding cache
        keeps the same ``window - 1`` tokens."""
        return 0 if self.window is None else max(0, num_tokens - (self.window - 1))


def _group_spec(group: Any) -> Any:
    spec = group.kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: all the same type
    return next(iter(specs.values())) if specs else spec


def kv_cache_groups(kv_cache_config: Any) -> tuple[KVCacheGroup, ...]:
    """The groups of vLLM's ``kv_cache_config``, in vLLM's order (the order of the block
    tables ``request_finished_all_groups`` gets). Raises :class:`KVLayoutError` for a
    group whose tokens kvbridge cannot describe (chunked-local, Mamba, cross-attention, a
    sliding window with a gap): only full-attention and sliding-window KV are sent."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = _group_spec(group)
        layers = tuple(sorted({extract_layer_index(name) for name in group.layer_names}))
        if type(spec) is SlidingWindowSpec:
            groups.append(KVCacheGroup(layers, int(spec.sliding_window)))
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            # With the hybrid allocator off, vLLM gives sliding layers a full-attention spec
            # (and keeps every token for them): they are sent whole.
            groups.append(KVCacheGroup(layers))
        else:
            raise KVLayoutError(
                f"KV cache group {i} (layers {list(layers)}) is {type(spec).__name__}: kvbridge "
                "sends full-attention and sliding-window KV only"
            )
    return tuple(groups)
