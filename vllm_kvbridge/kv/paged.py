"""Reading a request's K/V out of vLLM's paged caches (and writing it back), per KV cache group.

A request's tokens sit in the blocks of its block table (:mod:`vllm_kvbridge.kv.layout`
says how a page is laid out). With vLLM's hybrid allocator a model whose layers attend
differently keeps one block table per *KV cache group*: full-attention layers hold the
whole sequence; sliding-window layers only the last ``window - 1`` tokens (the blocks
before them went back to the pool and read as vLLM's null block, id 0). A
:class:`BlockTable` is one group's table and the first token it still holds; each layer
reads its group's table, so a sliding layer's K/V is ``[seq_len - start, heads, D]``
(what transformers' sliding-window cache keeps, too).

Copies: :class:`RequestGather` makes **one** copy of each layer's tokens: an
``index_select`` on the block dim of a strided view of the cache (only the requested
heads), written straight into the dense destination through ``out=``, and the tokens of
a block entered or left part-way copied from views of it. The destination may be any
contiguous tensor of the right shape, e.g. a view into a connector's shared-memory
segment (:func:`gather_layers_into`), so the KV bytes are copied once from vLLM's cache
to where the receiver reads them. All plain torch ops: they run on CPU and CUDA tensors
alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_kvbridge.kv.layout import (
    KVCacheLayout,
    KVLayoutError,
    check_dense,
    copy_blocks,
    head_range,
    token_views,
)
from vllm_kvbridge.wire.host_staging import to_device
from vllm_kvbridge.wire.kv_format import KEY, VALUE  # the descriptor kinds: one numbering

__all__ = [
    "BlockTable",
    "RequestGather",
    "gather",
    "gather_layers",
    "gather_layers_into",
    "request_block_index",
    "scatter",
]


@dataclass(frozen=True)
class BlockTable:
    """One KV cache group's blocks of a request, in token order from position 0, and the
    first token they still hold (``start``; 0 for full attention). Entries of blocks wholly
    before ``start`` are not read (vLLM gave them back: its null block)."""

    block_ids: Sequence[int] | torch.Tensor
    start: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise KVLayoutError(f"a block table's start must be an int >= 0, got {self.start!r}")


def request_block_index(
    block_ids: Sequence[int] | torch.Tensor,
    seq_len: int,
    layout: KVCacheLayout,
    num_blocks: int,
    device: torch.device | str | None = None,
    *,
    start: int = 0,
) -> torch.Tensor:
    """Validated int64 tensor of the *tensor* blocks holding tokens ``[start, seq_len)``.

    ``block_ids`` are the scheduler's (manager) block ids in token order from position 0;
    the ones before ``start``'s block and past the ones ``seq_len`` needs are ignored.
    Raises :class:`KVLayoutError` for a non-positive ``seq_len``, a ``start`` past it, too
    few blocks, negative/out-of-range/duplicate ids. Build it once per request and table.
    """
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len <= 0:
        raise KVLayoutError(f"seq_len must be a positive int, got {seq_len!r}")
    if not 0 <= start < seq_len:
        raise KVLayoutError(f"start {start} is outside [0, seq_len={seq_len})")
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
    per = layout.tokens_per_block
    needed = math.ceil(seq_len / per)
    if len(ids) < needed:
        raise KVLayoutError(
            f"{len(ids)} blocks hold at most {len(ids) * per} tokens, seq_len is {seq_len} (block size {per})"
        )
    ids = ids[start // per : needed]
    for b in ids:
        if b < 0 or b >= num_blocks:
            raise KVLayoutError(f"block id {b} is out of range [0, {num_blocks})")
    if len(set(ids)) != len(ids):
        raise KVLayoutError(f"block ids repeat: {ids}")
    index = torch.tensor(ids, dtype=torch.int64)
    k = layout.blocks_per_block
    if k > 1:
        index = (index[:, None] * k + torch.arange(k)[None, :]).reshape(-1)
        # vLLM split each manager block into k tensor blocks: start at start's own one
        index = index[(start % per) // layout.block_size :]
    return to_device(index, device) if device is not None else index


def _gather_blocks(
    blocks: torch.Tensor,
    index: torch.Tensor,
    host_index: torch.Tensor,
    dense: torch.Tensor,
    count: int,
    first: int,
) -> None:
    """Copy tokens ``[first, first + count)`` of the blocks ``index`` of ``blocks`` (a
    ``[num_blocks, N1, N2, h, D1, D2]`` view of a whole cache, see :func:`token_views`;
    ``first`` < one block) into the contiguous ``dense`` (``[count, h, D]``), each byte
    once: the whole blocks in one indexed copy straight into ``dense``, the tokens of a
    block entered or left part-way from views of it (their ids read from ``host_index``,
    the same ids on the host: no device sync)."""
    _, n1, n2, h, d1, d2 = blocks.shape
    n = n1 * n2
    done, at = 0, 0  # tokens written; index position of the next block
    if first:
        head = min(count, n - first)
        b = int(host_index[0])
        copy_blocks(blocks[b : b + 1], dense[:head], head, into_dense=True, first=first)
        done, at = head, 1
    full = (count - done) // n
    if full:
        out = dense[done : done + full * n].view(full, n1, n2, h, d1, d2)
        ptr = out.data_ptr()
        torch.index_select(blocks, 0, index[at : at + full], out=out)
        if out.data_ptr() != ptr:  # torch resizes a mismatched `out` instead of writing it
            raise KVLayoutError("internal error: the gather did not write into its destination")
        done, at = done + full * n, at + full
    if done < count:
        b = int(host_index[at])
        copy_blocks(blocks[b : b + 1], dense[done:], count - done, into_dense=True)


class RequestGather:
    """One request's blocks in every layer's cache, validated once; :meth:`write` copies one
    layer's K or V (``kind``: :data:`KEY` / :data:`VALUE`) into a destination, one copy.

    ``tables`` are the request's block tables: a list of block ids (one table, every layer
    from token 0) or one :class:`BlockTable` per KV cache group, with ``layer_tables``
    naming each layer's group. Layer ``l`` yields tokens ``[starts[l], seq_len)``.

    The sender's one-copy path builds one per request and route, and writes each tensor
    straight into the connector's destination buffer (``wire.TensorFill``)."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        layout: KVCacheLayout,
        tables: Sequence[int] | torch.Tensor | Sequence[BlockTable],
        seq_len: int,
        *,
        layer_tables: Sequence[int] | None = None,
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
        if isinstance(tables, torch.Tensor) or not (len(tables) and isinstance(tables[0], BlockTable)):
            tables = [BlockTable(tables)]  # type: ignore[arg-type]  # one table, from token 0
        if layer_tables is None:
            if len(tables) != 1:
                raise KVLayoutError(f"{len(tables)} block tables need layer_tables")
            layer_tables = [0] * len(kv_caches)
        if len(layer_tables) != len(kv_caches) or any(not 0 <= g < len(tables) for g in layer_tables):
            raise KVLayoutError(
                f"layer_tables {list(layer_tables)} do not map {len(kv_caches)} layers to tables"
            )
        self.kv_caches, self.layout, self.seq_len = list(kv_caches), layout, seq_len
        self.tables: list[BlockTable] = list(tables)  # type: ignore[arg-type]
        self.layer_tables = list(layer_tables)
        #: per table: its blocks' index on the host and on the device
        self._host_index = [
            request_block_index(t.block_ids, seq_len, layout, num_blocks, start=t.start) for t in self.tables
        ]
        self._index = [to_device(i, first.device) for i in self._host_index]  # never a sync per request
        self.head_start, self.head_end = head_range(layout, head_start, head_end)
        self.dtype, self.device = first.dtype, first.device

    @property
    def layer_starts(self) -> list[int]:
        """Per layer, the first token its K/V holds."""
        return [self.tables[g].start for g in self.layer_tables]

    def shape(self, layer: int, kind: int) -> tuple[int, int, int]:
        """Destination shape of one layer's ``kind``: ``[tokens, heads, head_size(_v)]``."""
        dim = self.layout.head_size if kind == KEY else self.layout.head_size_v
        return (
            self.seq_len - self.tables[self.layer_tables[layer]].start,
            self.head_end - self.head_start,
            dim,
        )

    def empty(self, layer: int, kind: int) -> torch.Tensor:
        """A new destination for one layer's ``kind``."""
        return torch.empty(self.shape(layer, kind), dtype=self.dtype, device=self.device)

    def write(self, layer: int, kind: int, out: torch.Tensor) -> torch.Tensor:
        """Copy layer ``layer``'s ``kind`` tokens into ``out`` (contiguous, that shape); returns it."""
        name = ("out_k", "out_v")[kind]
        check_dense(out, name, self.shape(layer, kind), self.dtype, self.device)
        if not out.is_contiguous():
            raise KVLayoutError(f"{name} must be contiguous")
        cache = self.kv_caches[layer]
        whole = (self.head_start, self.head_end) == (0, self.layout.num_kv_heads)
        src = cache if whole else cache[:, self.head_start : self.head_end]
        g = self.layer_tables[layer]
        index, host_index = self._index[g], self._host_index[g]
        try:
            views = token_views(src, self.layout)
        except RuntimeError:
            # A cache whose pages cannot be viewed in place (a strided layout vLLM does not
            # use today): copy the request's pages out first (a second copy, still exact).
            src = src.index_select(0, index)
            host_index = torch.arange(index.numel())
            index = to_device(host_index, index.device)
            views = token_views(src, self.layout)
        start = self.tables[g].start  # the index begins at the tensor block holding it
        _gather_blocks(
            views[kind], index, host_index, out, self.seq_len - start, start % self.layout.block_size
        )
        return out

    def device_indexes(self) -> list[torch.Tensor]:
        """Every table's block index on the cache's device."""
        return list(self._index)


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
    block_ids: Sequence[int] | torch.Tensor | Sequence[BlockTable],
    seq_len: int,
    *,
    layer_tables: Sequence[int] | None = None,
    head_start: int = 0,
    head_end: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`gather` for every layer into new tensors, validating the block ids once."""
    return gather_layers_into(
        kv_caches,
        layout,
        block_ids,
        seq_len,
        None,
        None,
        layer_tables=layer_tables,
        head_start=head_start,
        head_end=head_end,
    )


def gather_layers_into(
    kv_caches: Sequence[torch.Tensor],
    layout: KVCacheLayout,
    block_ids: Sequence[int] | torch.Tensor | Sequence[BlockTable],
    seq_len: int,
    out_keys: Sequence[torch.Tensor] | None,
    out_values: Sequence[torch.Tensor] | None,
    *,
    layer_tables: Sequence[int] | None = None,
    head_start: int = 0,
    head_end: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`gather` for every layer, validating the block ids once.

    ``out_keys``/``out_values`` (one contiguous tensor per layer of
    :meth:`RequestGather.shape`, e.g. views into a connector's destination buffer) receive
    the KV with one copy from the cache; ``None`` allocates them. Returns the filled tensors.
    """
    request = RequestGather(
        kv_caches,
        layout,
        block_ids,
        seq_len,
        layer_tables=layer_tables,
        head_start=head_start,
        head_end=head_end,
    )
    outs = []
    for kind, given in ((KEY, out_keys), (VALUE, out_values)):
        if given is not None and len(given) != len(kv_caches):
            raise KVLayoutError(f"{len(given)} destination tensors for {len(kv_caches)} layers")
        outs.append(
            [
                request.write(layer, kind, given[layer] if given is not None else request.empty(layer, kind))
                for layer in range(len(kv_caches))
            ]
        )
    return outs[0], outs[1]


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
    hs, he = head_range(layout, head_start, head_end)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 3:
        raise KVLayoutError("k and v must be 3-D tensors [seq_len, heads, head_size]")
    seq_len = int(k.shape[0])
    check_dense(k, "k", (seq_len, he - hs, layout.head_size), cache.dtype, cache.device)
    check_dense(v, "v", (seq_len, he - hs, layout.head_size_v), cache.dtype, cache.device)
    index = request_block_index(block_ids, seq_len, layout, num_blocks, cache.device)
    src = cache if (hs, he) == (0, layout.num_kv_heads) else cache[:, hs:he]
    pages = src.index_select(0, index)
    k_blocks, v_blocks = token_views(pages, layout)
    copy_blocks(k_blocks, k.contiguous(), seq_len, into_dense=False)
    copy_blocks(v_blocks, v.contiguous(), seq_len, into_dense=False)
    src.index_copy_(0, index, pages)
