"""The KV container's msgpack header and its validation.

The header is described in :mod:`vllm_kvbridge.wire.kv_format`, which builds and reads
:class:`~vllm_kvbridge.wire.kv_format.KVCacheTransferData` on top of this module: here are
the descriptor and header types, :func:`decode_header`, :func:`validate_header` (every
descriptor and field, before any tensor is built) and the JSON-safety check of metadata.
"""

from __future__ import annotations

import math
from itertools import chain
from typing import Any

import msgspec

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire._buffers import INT64_MAX, check_shape, check_wire_shape, contiguous_strides
from vllm_kvbridge.wire.limits import Limits

KEY = 0
VALUE = 1
#: ``layer_blocks`` keys, indexed by descriptor kind.
KINDS = ("key_cache", "value_cache")


class TensorDesc(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Where one K or V tensor lives: ``[layer, kind, dtype, shape, offset, nbytes]``."""

    layer: int
    kind: int
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


class KVHeader(msgspec.Struct, forbid_unknown_fields=True):
    """The msgpack header of the KV container (see :mod:`vllm_kvbridge.wire.kv_format`)."""

    request_id: str
    num_layers: int
    tensors: list[TensorDesc]
    block_ids: list[int]
    seq_len: int | None
    block_size: int | None
    tp_rank: int
    tp_size: int
    head_start: int | None
    head_end: int | None
    num_kv_heads_total: int | None
    metadata: dict[str, Any]
    #: per layer, the position of the first token its tensors hold (a sliding-window
    #: layer's window, vLLM's hybrid allocator); None: every layer from token 0
    layer_starts: list[int] | None = None


header_encoder = msgspec.msgpack.Encoder()
_SEQ, _STR, _INT = {list, tuple}, {str}, {int}
_header_decoder = msgspec.msgpack.Decoder(KVHeader)


# -- validation --------------------------------------------------------------------------
def check_json_safe(obj: Any, limits: Limits, what: str = "metadata") -> None:
    """Raise PayloadError unless ``obj`` is a JSON-safe dict within ``limits``.

    JSON-safe: dicts with str keys, lists, str, finite floats, int64 ints, bool, None.
    Tuples are rejected (JSON would turn them into lists, breaking exact round trips).
    """
    if type(obj) is not dict:
        raise PayloadError(f"{what} must be a dict, got {type(obj).__name__}")
    budget = [limits.max_items]

    def walk(node: Any, depth: int, path: str) -> None:
        budget[0] -= 1
        if budget[0] < 0:
            raise PayloadError(f"{what} has more than max_items={limits.max_items} items")
        t = type(node)
        if t is str:
            if len(node) > limits.max_str_bytes or len(node.encode("utf-8", "surrogatepass")) > (
                limits.max_str_bytes
            ):
                raise PayloadError(f"{what}{path}: string exceeds max_str_bytes={limits.max_str_bytes}")
        elif t is bool or node is None:
            pass
        elif t is int:
            if not -INT64_MAX - 1 <= node <= INT64_MAX:
                raise PayloadError(f"{what}{path}: int {node} does not fit in 64 bits")
        elif t is float:
            if not math.isfinite(node):
                raise PayloadError(f"{what}{path}: {node} is not JSON-safe (not finite)")
        elif t is dict or t is list:
            if depth >= limits.max_depth:
                raise PayloadError(f"{what}{path}: nesting exceeds max_depth={limits.max_depth}")
            if t is dict:
                for key, value in node.items():
                    if type(key) is not str:
                        raise PayloadError(f"{what}{path}: key {key!r} is not a str (JSON-safe keys only)")
                    walk(value, depth + 1, f"{path}[{key!r}]")
            else:
                for i, value in enumerate(node):
                    walk(value, depth + 1, f"{path}[{i}]")
        else:
            raise PayloadError(f"{what}{path}: {t.__name__} is not JSON-safe")

    walk(obj, 0, "")


def _check_int(value: Any, name: str, *, minimum: int = 0, optional: bool = False) -> None:
    if value is None and optional:
        return
    if type(value) is not int or not minimum <= value <= INT64_MAX:
        raise PayloadError(f"{name} must be an int >= {minimum}, got {value!r}")


def validate_header(h: KVHeader, limits: Limits) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Everything in a header that does not depend on where the bytes live.

    Returns the validated ``(shape, strides)`` of every descriptor, in order.
    """
    validate_fields(h, limits)
    checked = _validate_descs(h, limits)
    starts = h.layer_starts
    if h.seq_len is not None and starts is not None:  # (most KV has no windows: no loop)
        for d, (shape, _) in zip(h.tensors, checked):
            rows = h.seq_len - starts[d.layer]
            if not shape or shape[0] != rows:
                raise PayloadError(
                    f"{KINDS[d.kind]}[{d.layer}]: {shape[0] if shape else 0} tokens, but layer_starts "
                    f"says {rows} (seq_len {h.seq_len}, start {starts[d.layer]})"
                )
    return checked


def _validate_descs(h: KVHeader, limits: Limits) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The tensor descriptors: ranges, dtypes, shapes vs nbytes, duplicates, K/V agreement.

    Returns ``(shape, strides)`` per descriptor. The common case (everything valid) is
    checked with whole-list operations (min/max/set/sum run in C) and one memoised shape
    check per descriptor; when anything fails, :func:`_diagnose_descs` re-checks one
    descriptor at a time to raise the error naming the first bad one.
    """
    descs = h.tensors
    n = len(descs)
    if n > limits.max_buffers:
        raise PayloadError(f"{n} tensors exceed max_buffers={limits.max_buffers}")
    if not n:
        return []
    layers = [d.layer for d in descs]
    kinds = [d.kind for d in descs]
    nbytes = [d.nbytes for d in descs]
    offsets = [d.offset for d in descs]
    shapes = [d.shape for d in descs]
    dtypes = [d.dtype for d in descs]
    # Exact types first (a typed decode guarantees them; a hand-built header may not):
    # plain ints only (a bool would compare equal to 0/1), which also makes the memoised
    # shape check below exact.
    ok = (
        set(map(type, shapes)) <= _SEQ
        and set(map(type, dtypes)) == _STR
        and set(map(type, chain(layers, kinds, nbytes, offsets, chain.from_iterable(shapes)))) <= _INT
        and min(layers) >= 0
        and max(layers) < h.num_layers
        and min(kinds) >= KEY
        and max(kinds) <= VALUE
        and min(nbytes) >= 0
        and max(nbytes) <= INT64_MAX
        and min(offsets) >= 0
        and max(offsets) <= INT64_MAX
        and sum(nbytes) <= limits.max_total_bytes
        and len(set(zip(layers, kinds))) == n
    )
    checked: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if ok:
        try:
            checked = [check_wire_shape(d.shape, d.dtype, d.nbytes, limits, "") for d in descs]
        except PayloadError:
            ok = False
    if ok:
        key_shapes = {layer: c[0] for layer, kind, c in zip(layers, kinds, checked) if kind == KEY}
        ok = all(
            key_shapes.get(layer, c[0]) == c[0]
            for layer, kind, c in zip(layers, kinds, checked)
            if kind == VALUE
        )
    if not ok:
        return _diagnose_descs(h, limits)
    return checked


def _diagnose_descs(h: KVHeader, limits: Limits) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The scalar form of the checks: descriptor by descriptor, raising PayloadError naming
    the first problem. Used when the batched check says no (it may be stricter, e.g. about
    a hand-built header; then this one decides)."""
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    total = 0
    for i, d in enumerate(h.tensors):
        if type(d.layer) is not int or not 0 <= d.layer < h.num_layers:
            raise PayloadError(f"tensor descriptor {i}: layer {d.layer!r} outside [0, {h.num_layers})")
        if d.kind not in (KEY, VALUE) or type(d.kind) is not int:
            raise PayloadError(f"tensor descriptor {i}: kind {d.kind!r} is neither 0 (key) nor 1 (value)")
        what = f"{KINDS[d.kind]}[{d.layer}]"
        _check_int(d.nbytes, f"{what}.nbytes")
        _check_int(d.offset, f"{what}.offset")
        shape = check_shape(d.shape, d.dtype, d.nbytes, limits, what)
        if (d.layer, d.kind) in seen:
            raise PayloadError(f"duplicate descriptor for {what}")
        seen[(d.layer, d.kind)] = shape
        total += d.nbytes
        if total > limits.max_total_bytes:
            raise PayloadError(f"tensor bytes exceed max_total_bytes={limits.max_total_bytes}")
    for (layer, kind), shape in seen.items():
        other = seen.get((layer, VALUE))
        if kind == KEY and other is not None and other != shape:
            raise PayloadError(f"layer {layer}: key shape {list(shape)} and value shape {list(other)} differ")
    return [(shape, contiguous_strides(shape)) for shape in (tuple(d.shape) for d in h.tensors)]


def validate_fields(h: KVHeader, limits: Limits) -> None:
    """Everything but the tensor descriptors."""
    if type(h.request_id) is not str or len(h.request_id.encode("utf-8", "surrogatepass")) > (
        limits.max_str_bytes
    ):
        raise PayloadError("request_id must be a str within max_str_bytes")
    _check_int(h.num_layers, "num_layers")
    if h.num_layers > limits.max_items:
        raise PayloadError(f"num_layers {h.num_layers} exceeds max_items={limits.max_items}")
    if type(h.block_ids) is not list or len(h.block_ids) > limits.max_items:
        raise PayloadError("block_ids must be a list within max_items")
    for block in h.block_ids:
        if type(block) is not int or not 0 <= block <= INT64_MAX:
            raise PayloadError(f"block id {block!r} is not a non-negative int64")
    _check_int(h.seq_len, "seq_len", optional=True)
    _check_int(h.block_size, "block_size", minimum=1, optional=True)
    _check_int(h.tp_size, "tp_size", minimum=1)
    _check_int(h.tp_rank, "tp_rank")
    if h.tp_rank >= h.tp_size:
        raise PayloadError(f"tp_rank {h.tp_rank} must be < tp_size {h.tp_size}")
    _check_int(h.head_start, "head_start", optional=True)
    _check_int(h.head_end, "head_end", optional=True)
    _check_int(h.num_kv_heads_total, "num_kv_heads_total", optional=True)
    if (h.head_start is None) != (h.head_end is None):
        raise PayloadError("head_start and head_end must be given together")
    if h.head_start is not None and h.head_start > h.head_end:
        raise PayloadError(f"head_start {h.head_start} > head_end {h.head_end}")
    if h.num_kv_heads_total is not None and h.head_end is not None and h.head_end > h.num_kv_heads_total:
        raise PayloadError(f"head_end {h.head_end} > num_kv_heads_total {h.num_kv_heads_total}")
    if h.layer_starts is not None:
        starts = h.layer_starts
        if type(starts) is not list or len(starts) != h.num_layers:
            raise PayloadError(f"layer_starts must be a list of num_layers={h.num_layers} ints")
        end = h.seq_len if h.seq_len is not None else INT64_MAX
        for layer, start in enumerate(starts):
            if type(start) is not int or not 0 <= start < max(end, 1):
                raise PayloadError(f"layer_starts[{layer}] = {start!r} is outside [0, seq_len={h.seq_len})")
    check_json_safe(h.metadata, limits)


def decode_header(raw: bytes | memoryview) -> KVHeader:
    try:
        return _header_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PayloadError(f"malformed KV header: {exc}") from None
    except RecursionError:
        raise PayloadError("malformed KV header: nesting too deep") from None
