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

Copies: :func:`gather` makes **one** copy of the request's tokens: an ``index_select``
on the block dim of a strided view of the cache (only the requested heads), written
straight into the dense destination through ``out=``, and the tokens of the last,
partial block copied from a view of it. The destination may be any contiguous tensor of the
right shape, e.g. a view into a connector's shared-memory segment
(:func:`gather_layers_into`), so the KV bytes are copied once from vLLM's cache to where
the receiver reads them. All plain torch ops: they run on CPU and CUDA tensors alike.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_kvbridge.errors import KVBridgeError
from vllm_kvbridge.wire.host_staging import to_device
from vllm_kvbridge.wire.kv_format import KEY, VALUE  # the descriptor kinds: one numbering

__all__ = [
    "KVCacheLayout",
    "KVContent",
    "KVLayoutError",
    "cpu_layout",
    "gather",
    "gather_layers",
    "gather_layers_into",
    "packed_layout",
    "request_block_index",
    "scatter",
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


# -- block ids ----------------------------------------------------------------------------


def request_block_index(
    block_ids: Sequence[int] | torch.Tensor,
    seq_len: int,
    layout: KVCacheLayout,
    num_blocks: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Validated int64 tensor of the *tensor* blocks holding tokens ``[0, seq_len)``.

    ``block_ids`` are the scheduler's (manager) block ids in token order; blocks past
    the ones ``seq_len`` needs are ignored. Raises :class:`KVLayoutError` for a
    non-positive ``seq_len``, too few blocks, negative/out-of-range/duplicate ids.
    Build it once per request and pass it to :func:`gather` for every layer.
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise KVLayoutError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise KVLayoutError(
                f"block ids must be a 1-D integer tensor, got {block_ids.dtype} {tuple(block_ids.shape)}"
            )
        ids = [int(x) for x in block_ids.tolist()]
    else:
        ids = list(block_ids)
        for b in ids:
            if not isinstance(b, int) or isinstance(b, bool):
                raise KVLayoutError(f"block ids must be ints, got {b!r}")
    needed = math.ceil(seq_len / layout.tokens_per_block)
    if len(ids) < needed:
        raise KVLayoutError(
            f"{len(ids)} blocks hold at most {len(ids) * layout.tokens_per_block} tokens, "
            f"seq_len is {seq_len} (block size {layout.tokens_per_block})"
        )
    ids = ids[:needed]
    for b in ids:
        if b < 0 or b >= num_blocks:
            raise KVLayoutError(f"block id {b} is out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise KVLayoutError(f"block ids repeat: {ids}")
    index = torch.tensor(ids, dtype=torch.int64)
    k = layout.blocks_per_block
    if k > 1:
        index = (index[:, None] * k + torch.arange(k)[None, :]).reshape(-1)
    return to_device(index, device) if device is not None else index


def _head_range(layout: KVCacheLayout, head_start: int, head_end: int | None) -> tuple[int, int]:
    end = layout.num_kv_heads if head_end is None else head_end
    if not (0 <= head_start < end <= layout.num_kv_heads):
        raise KVLayoutError(f"head range [{head_start}, {end}) outside [0, {layout.num_kv_heads})")
    return head_start, end


def _token_views(pages: torch.Tensor, layout: KVCacheLayout) -> tuple[torch.Tensor, torch.Tensor]:
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


def _gather_blocks(
    blocks: torch.Tensor, index: torch.Tensor, host_index: torch.Tensor, dense: torch.Tensor, seq_len: int
) -> None:
    """Copy the first ``seq_len`` tokens of the blocks ``index`` of ``blocks`` (a
    ``[num_blocks, N1, N2, h, D1, D2]`` view of a whole cache, see :func:`_token_views`)
    into the contiguous ``dense`` (``[seq, h, D]``), each byte once: the whole blocks in
    one indexed copy straight into ``dense``, the tokens of the last partial block from a
    view of it (its id read from ``host_index``, the same ids on the host: no device sync)."""
    _, n1, n2, h, d1, d2 = blocks.shape
    n = n1 * n2
    full, rem = divmod(seq_len, n)
    if full:
        out = dense[: full * n].view(full, n1, n2, h, d1, d2)
        ptr = out.data_ptr()
        torch.index_select(blocks, 0, index[:full], out=out)
        if out.data_ptr() != ptr:  # torch resizes a mismatched `out` instead of writing it
            raise KVLayoutError("internal error: the gather did not write into its destination")
    if rem:
        last = int(host_index[full])
        _copy_blocks(blocks[last : last + 1], dense[full * n :], rem, into_dense=True)


def _copy_blocks(blocks: torch.Tensor, dense: torch.Tensor, seq_len: int, *, into_dense: bool) -> None:
    """Copy between the first ``seq_len`` tokens of ``blocks`` (a ``[nb, N1, N2, h, D1, D2]``
    view, see :func:`_token_views`) and the contiguous ``dense`` (``[seq, h, D]``): whole
    blocks in one strided copy, the last partial block ``N2`` tokens at a time."""
    _, n1, n2, h, d1, d2 = blocks.shape
    n = n1 * n2
    full, rem = divmod(seq_len, n)
    pairs = [(blocks[:full], dense[: full * n].view(full, n1, n2, h, d1, d2))] if full else []
    for i in range(0, rem, n2):
        m, at = min(n2, rem - i), full * n + i
        pairs.append((blocks[full, i // n2, :m], dense[at : at + m].view(m, h, d1, d2)))
    for b, x in pairs:
        if into_dense:
            x.copy_(b)
        else:
            b.copy_(x)


def _check_dense(
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


def gather(
    cache: torch.Tensor,
    layout: KVCacheLayout,
    block_ids: Sequence[int] | torch.Tensor,
    seq_len: int,
    out_k: torch.Tensor | None = None,
    out_v: torch.Tensor | None = None,
    *,
    head_start: int = 0,
    head_end: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``(k, v)``, each ``[seq_len, heads, head_size(_v)]``, of one layer.

    ``block_ids`` may be a list of manager block ids or the tensor returned by
    :func:`request_block_index`.
    ``head_start``/``head_end`` select a head range (TP slicing on the sender, so only
    the needed heads are copied). ``out_k``/``out_v``, if given, must be contiguous
    tensors of exactly that shape, dtype and device; they are filled and returned.
    """
    keys, values = gather_layers_into(
        [cache],
        layout,
        block_ids,
        seq_len,
        None if out_k is None else [out_k],
        None if out_v is None else [out_v],
        head_start=head_start,
        head_end=head_end,
    )
    return keys[0], values[0]


def gather_layers(
    kv_caches: Sequence[torch.Tensor],
    layout: KVCacheLayout,
    block_ids: Sequence[int] | torch.Tensor,
    seq_len: int,
    *,
    head_start: int = 0,
    head_end: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`gather` for every layer into new tensors, validating the block ids once."""
    return gather_layers_into(
        kv_caches, layout, block_ids, seq_len, None, None, head_start=head_start, head_end=head_end
    )


def gather_layers_into(
    kv_caches: Sequence[torch.Tensor],
    layout: KVCacheLayout,
    block_ids: Sequence[int] | torch.Tensor,
    seq_len: int,
    out_keys: Sequence[torch.Tensor] | None,
    out_values: Sequence[torch.Tensor] | None,
    *,
    head_start: int = 0,
    head_end: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`gather` for every layer, validating the block ids once.

    ``out_keys``/``out_values`` (one contiguous ``[seq_len, heads, D]`` tensor per layer,
    e.g. views into a connector's destination buffer) receive the KV with one copy from
    the cache; ``None`` allocates them. Returns the filled tensors.
    """
    request = RequestGather(kv_caches, layout, block_ids, seq_len, head_start=head_start, head_end=head_end)
    outs = []
    for kind, given in ((KEY, out_keys), (VALUE, out_values)):
        if given is not None and len(given) != len(kv_caches):
            raise KVLayoutError(f"{len(given)} destination tensors for {len(kv_caches)} layers")
        outs.append(
            [
                request.write(layer, kind, given[layer] if given is not None else request.empty(kind))
                for layer in range(len(kv_caches))
            ]
        )
    return outs[0], outs[1]


class RequestGather:
    """One request's blocks in every layer's cache, validated once; :meth:`write` copies one
    layer's K or V (``kind``: :data:`KEY` / :data:`VALUE`) into a destination, one copy.

    The sender's one-copy path builds one per request and route, and writes each tensor
    straight into the connector's destination buffer (``wire.TensorFill``)."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVCacheLayout,
        block_ids: Sequence[int] | torch.Tensor,
        seq_len: int,
        *,
        head_start: int = 0,
        head_end: int | None = None,
    ) -> None:
        if not kv_caches:
            raise KVLayoutError("no KV cache layers given")
        first = kv_caches[0]
        num_blocks = layout.check_cache(first)
        for cache in kv_caches:
            if cache.shape[0] != first.shape[0] or cache.device != first.device:
                raise KVLayoutError("all layers must have the same number of blocks and device")
            layout.check_cache(cache)
        self.kv_caches, self.layout, self.seq_len = list(kv_caches), layout, seq_len
        self.host_index = request_block_index(block_ids, seq_len, layout, num_blocks)
        self.index = to_device(self.host_index, first.device)  # never a sync per request
        self.head_start, self.head_end = _head_range(layout, head_start, head_end)
        heads = self.head_end - self.head_start
        #: destination shape per kind: ``[seq_len, heads, head_size(_v)]``
        self.shapes = ((seq_len, heads, layout.head_size), (seq_len, heads, layout.head_size_v))
        self.dtype, self.device = first.dtype, first.device

    def empty(self, kind: int) -> torch.Tensor:
        """A new destination for one layer's ``kind``."""
        return torch.empty(self.shapes[kind], dtype=self.dtype, device=self.device)

    def write(self, layer: int, kind: int, out: torch.Tensor) -> torch.Tensor:
        """Copy layer ``layer``'s ``kind`` tokens into ``out`` (contiguous, that shape); returns it."""
        name = ("out_k", "out_v")[kind]
        _check_dense(out, name, self.shapes[kind], self.dtype, self.device)
        if not out.is_contiguous():
            raise KVLayoutError(f"{name} must be contiguous")
        cache = self.kv_caches[layer]
        whole = (self.head_start, self.head_end) == (0, self.layout.num_kv_heads)
        src = cache if whole else cache[:, self.head_start : self.head_end]
        index, host_index = self.index, self.host_index
        try:
            views = _token_views(src, self.layout)
        except RuntimeError:
            # A cache whose pages cannot be viewed in place (a strided layout vLLM does not
            # use today): copy the request's pages out first (a second copy, still exact).
            src = src.index_select(0, index)
            host_index = torch.arange(index.numel())
            index = to_device(host_index, index.device)
            views = _token_views(src, self.layout)
        _gather_blocks(views[kind], index, host_index, out, self.seq_len)
        return out


def scatter(
    cache: torch.Tensor,
    layout: KVCacheLayout,
    block_ids: Sequence[int] | torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    head_start: int = 0,
    head_end: int | None = None,
) -> None:
    """Write dense ``k``/``v`` (``[seq_len, heads, D]``) into the given blocks of one layer.

    The inverse of :func:`gather`; ``seq_len`` is ``k.shape[0]``. Tokens of the last
    block past ``seq_len`` and heads outside the range keep their values.
    """
    num_blocks = layout.check_cache(cache)
    hs, he = _head_range(layout, head_start, head_end)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 3:
        raise KVLayoutError("k and v must be 3-D tensors [seq_len, heads, head_size]")
    seq_len = int(k.shape[0])
    _check_dense(k, "k", (seq_len, he - hs, layout.head_size), cache.dtype, cache.device)
    _check_dense(v, "v", (seq_len, he - hs, layout.head_size_v), cache.dtype, cache.device)
    index = request_block_index(block_ids, seq_len, layout, num_blocks, cache.device)
    src = cache if (hs, he) == (0, layout.num_kv_heads) else cache[:, hs:he]
    pages = src.index_select(0, index)
    k_blocks, v_blocks = _token_views(pages, layout)
    _copy_blocks(k_blocks, k.contiguous(), seq_len, into_dense=False)
    _copy_blocks(v_blocks, v.contiguous(), seq_len, into_dense=False)
    src.index_copy_(0, index, pages)
