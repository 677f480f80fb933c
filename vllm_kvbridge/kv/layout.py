"""Reading a request's K/V out of vLLM's paged KV cache (and writing it back).

What vLLM 0.32 hands a model runner (``runner.kv_caches[i]``, ground truth:
``vllm/v1/kv_cache_interface.py::create_kv_cache_views``) is, for every attention
backend, one *logical* per-layer view ``[num_blocks, num_heads, block_size, C]``.
The physical memory order of that view is one of the stride permutations of
``vllm.v1.kv_cache_layout.KVCacheLayout`` (LBHNC, LBNHC, BLHNC, ...): torch strides
carry it, so indexing the logical view is correct for all of them. What differs
between backends is how K and V sit inside ``C``:

* ``KVContent.PACKED`` - the CUDA/ROCm backends (FlashAttention, FlashInfer, Triton,
  FlexAttention, ...): ``C = head_size + head_size_v`` per token, K first
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` in ``flash_attn.py``).
* ``KVContent.CPU_VEC`` - the CPU backend (``cpu_attn.py``): the layer is
  ``[num_blocks, num_kv_heads, block_size, 2*head_size]`` but the kernel views each
  ``(block, head)`` page as ``[2*block_size, head_size]`` and chunks it into a K half
  and a V half; ``cpu_attn_reshape_and_cache`` with the ``vec``/``vec16`` ISAs (x86
  without AMX) stores the K half *transposed*, ``[head_size, block_size]``, and the V
  half token-major, ``[block_size, head_size]``. So K and V are **not** packed per token
  in the last dim on CPU; the tests check this against the real kernel and a real engine.
* ``KVContent.CPU_AMX`` - the same CPU pages written by the ``amx`` ISA (x86 with AMX,
  bfloat16, ``block_size % 32 == 0``; the tile format AMX multiplies): the K half is
  ``[block_size/16, head_size/2, 16, 2]`` (16 tokens by pairs of channels) and the V half
  ``[head_size/16, block_size/2, 16, 2]`` (16 channels by pairs of tokens), so token
  ``t``'s K channel ``c`` sits at ``((t//16)*head_size/2 + c//2)*32 + (t%16)*2 + c%2``.
  Checked against vLLM's own ``cpu_attn_reshape_and_cache`` in the tests. Other CPU ISAs
  (``neon``, ``vsx``, ...) use kernel-private page formats and are refused with
  :class:`KVLayoutError` rather than read wrongly.

The layout is described by :class:`KVCacheLayout`, built from the backend and the KV
cache spec (:mod:`vllm_kvbridge.kv.layout_vllm`), never guessed from a
tensor's shape (``num_blocks == 2`` made old shape guessing ambiguous).

Reading and writing a request's tokens through these views (one copy, every KV cache
group, sliding windows): :mod:`vllm_kvbridge.kv.paged`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from vllm_kvbridge.errors import KVBridgeError

__all__ = [
    "KVCacheLayout",
    "KVContent",
    "KVLayoutError",
    "check_dense",
    "copy_blocks",
    "cpu_layout",
    "head_range",
    "packed_layout",
    "token_views",
]


class KVLayoutError(KVBridgeError, ValueError):
    """A cache, a layout, block ids or K/V tensors do not fit together."""


class KVContent(enum.StrEnum):
    """How K and V are arranged inside one ``(block, head)`` page."""

    PACKED = "packed"
    CPU_VEC = "cpu_vec"
    CPU_AMX = "cpu_amx"


#: CPU attention ISAs whose page format is CPU_VEC (checked against the kernel in the tests).
_CPU_VEC_ISAS = frozenset({"vec", "vec16"})
#: vLLM KVCacheLayout names (physical stride orders of the logical [L, B, H, N, C] view).
_PHYSICAL_ORDERS = frozenset({"LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"})


@dataclass(frozen=True)
class KVCacheLayout:
    """Everything needed to read one layer's paged cache tensor.

    ``block_size`` is the number of tokens per block *of the tensor* (vLLM's kernel
    block); ``blocks_per_block`` is how many tensor blocks make one block of the
    scheduler's block table (vLLM splits manager blocks into kernel blocks for some
    backends; manager block ``b`` is then tensor blocks ``b*k .. b*k+k-1``).
    """

    content: KVContent
    num_kv_heads: int
    head_size: int
    head_size_v: int
    block_size: int
    dtype: torch.dtype
    physical_order: str = "LBHNC"
    backend: str = ""
    cpu_isa: str | None = None
    blocks_per_block: int = 1

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_size", "head_size_v", "block_size", "blocks_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise KVLayoutError(f"KVCacheLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise KVLayoutError(f"KVCacheLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.physical_order not in _PHYSICAL_ORDERS:
            raise KVLayoutError(
                f"unknown physical order {self.physical_order!r} (vLLM KVCacheLayout names: "
                f"{sorted(_PHYSICAL_ORDERS)})"
            )
        if self.content is not KVContent.PACKED:
            if self.head_size_v != self.head_size:
                raise KVLayoutError("the CPU backend needs head_size_v == head_size")
            if self.physical_order != "LBHNC":
                raise KVLayoutError(f"the CPU backend only uses LBHNC, not {self.physical_order}")

    @property
    def content_size(self) -> int:
        """Elements of the last dim ``C`` of the per-layer view."""
        return self.head_size + self.head_size_v

    @property
    def tokens_per_block(self) -> int:
        """Tokens per block of the scheduler's block table."""
        return self.block_size * self.blocks_per_block

    def expected_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.num_kv_heads, self.block_size, self.content_size)

    def check_cache(self, cache: torch.Tensor) -> int:
        """Validate one layer tensor against this layout; return its number of manager blocks."""
        if not isinstance(cache, torch.Tensor):
            raise KVLayoutError(f"a layer cache must be a torch.Tensor, got {type(cache).__name__}")
        if cache.dim() != 4 or tuple(cache.shape[1:]) != self.expected_shape(0)[1:]:
            raise KVLayoutError(
                f"layer cache shape {tuple(cache.shape)} does not match the layout "
                f"[num_blocks, {self.num_kv_heads}, {self.block_size}, {self.content_size}] "
                f"({self.content.value}, backend {self.backend or '?'})"
            )
        if cache.dtype != self.dtype:
            raise KVLayoutError(f"layer cache dtype {cache.dtype} != layout dtype {self.dtype}")
        if cache.shape[0] % self.blocks_per_block:
            raise KVLayoutError(
                f"{cache.shape[0]} tensor blocks is not a multiple of "
                f"blocks_per_block={self.blocks_per_block}"
            )
        if self.content is not KVContent.PACKED:
            # The kernel reinterprets each (block, head) page; it must be one dense run.
            n, c = self.block_size, self.content_size
            if cache.stride(3) != 1 or cache.stride(2) != c or cache.stride(1) != n * c:
                raise KVLayoutError(f"CPU layer cache must have dense pages, strides are {cache.stride()}")
        return cache.shape[0] // self.blocks_per_block


def packed_layout(
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    head_size_v: int | None = None,
    physical_order: str = "LBNHC",
    backend: str = "FLASH_ATTN",
    blocks_per_block: int = 1,
) -> KVCacheLayout:
    """Layout of the CUDA backends (FlashAttention NHD = LBNHC, FlashInfer HND = LBHNC, ...)."""
    return KVCacheLayout(
        KVContent.PACKED,
        num_kv_heads,
        head_size,
        head_size if head_size_v is None else head_size_v,
        block_size,
        dtype,
        physical_order=physical_order,
        backend=backend,
        blocks_per_block=blocks_per_block,
    )


def cpu_layout(
    num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype, *, isa: str = "vec"
) -> KVCacheLayout:
    """Layout of vLLM's CPU attention backend for the given kernel ISA."""
    if isa == "amx":
        if block_size % 32 or head_size % 32:
            raise KVLayoutError(
                f"the amx page format needs block_size and head_size divisible by 32, "
                f"got {block_size} and {head_size}"
            )
        content = KVContent.CPU_AMX
    elif isa in _CPU_VEC_ISAS:
        content = KVContent.CPU_VEC
    else:
        raise KVLayoutError(
            f"CPU attention ISA {isa!r} stores K/V in a kernel-private page format that "
            f"vllm-kvbridge cannot read (supported: {sorted(_CPU_VEC_ISAS | {'amx'})})"
        )
    return KVCacheLayout(
        content,
        num_kv_heads,
        head_size,
        head_size,
        block_size,
        dtype,
        physical_order="LBHNC",
        backend="CPU_ATTN",
        cpu_isa=isa,
    )


# -- page views (kv/paged.py reads and writes a request's tokens through them) ----------


def head_range(layout: KVCacheLayout, head_start: int, head_end: int | None) -> tuple[int, int]:
    end = layout.num_kv_heads if head_end is None else head_end
    if not (0 <= head_start < end <= layout.num_kv_heads):
        raise KVLayoutError(f"head range [{head_start}, {end}) outside [0, {layout.num_kv_heads})")
    return head_start, end


def token_views(pages: torch.Tensor, layout: KVCacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``[nb, N1, N2, heads, D1, D2]`` of K and V into pages ``[nb, heads, N, C]``
    (the cache itself or a head slice of it): token ``n1*N2 + n2`` of a block, channel
    ``d1*D2 + d2``.

    Two split dims per axis express every page format as a view (the AMX tiles interleave
    tokens and channels); the packed and vec formats have singleton ``N1`` and ``D2``.
    Always views, never copies: ``view`` (not ``reshape``) raises where the strides do not
    allow one, rather than silently copying a whole cache."""
    if layout.content is KVContent.PACKED:
        tok = pages.permute(0, 2, 1, 3)[:, None, ..., None]
        return tok[..., : layout.head_size, :], tok[..., layout.head_size :, :]
    n, d = layout.block_size, layout.head_size
    flat = pages.view(pages.shape[0], pages.shape[1], 2 * n * d)
    if layout.content is KVContent.CPU_VEC:
        k = flat[..., : n * d].unflatten(-1, (d, n)).permute(0, 3, 1, 2)[:, None, ..., None]
        v = flat[..., n * d :].unflatten(-1, (n, d)).permute(0, 2, 1, 3)[:, None, ..., None]
        return k, v
    # CPU_AMX: K [N/16, D/2, 16, 2], V [D/16, N/2, 16, 2] per (block, head) page.
    k = flat[..., : n * d].unflatten(-1, (n // 16, d // 2, 16, 2)).permute(0, 2, 4, 1, 3, 5)
    v = flat[..., n * d :].unflatten(-1, (d // 16, n // 2, 16, 2)).permute(0, 3, 5, 1, 2, 4)
    return k, v


def copy_blocks(
    blocks: torch.Tensor, dense: torch.Tensor, seq_len: int, *, into_dense: bool, first: int = 0
) -> None:
    """Copy between tokens ``[first, first + seq_len)`` of ``blocks`` (a ``[nb, N1, N2, h, D1,
    D2]`` view, see :func:`token_views`; token ``t`` is in block ``t // N1*N2``) and the
    contiguous ``dense`` (``[seq_len, h, D]``): whole blocks in one strided copy, a block
    entered or left part-way ``N2`` tokens at a time."""
    _, n1, n2, h, d1, d2 = blocks.shape
    n = n1 * n2
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    t, end = first, first + seq_len

    def part_of_block(upto: int) -> None:
        nonlocal t
        while t < upto:
            b, r = divmod(t, n)
            m = min(n2 - r % n2, upto - t)
            pairs.append(
                (blocks[b, r // n2, r % n2 : r % n2 + m], dense[t - first : t - first + m].view(m, h, d1, d2))
            )
            t += m

    part_of_block(min(end, -(-first // n) * n))  # a window that starts inside a block
    full = (end - t) // n
    if full:
        b0 = t // n
        pairs.append(
            (blocks[b0 : b0 + full], dense[t - first : t - first + full * n].view(full, n1, n2, h, d1, d2))
        )
        t += full * n
    part_of_block(end)
    for b, x in pairs:
        if into_dense:
            x.copy_(b)
        else:
            b.copy_(x)


def check_dense(
    t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise KVLayoutError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise KVLayoutError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype != dtype:
        raise KVLayoutError(f"{name} dtype {t.dtype} != cache dtype {dtype}")
    if t.device != device:
        raise KVLayoutError(f"{name} is on {t.device}, the cache on {device}")
