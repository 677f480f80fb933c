"""The payload codec: a msgpack skeleton plus one out-of-band buffer per tensor/array.

:func:`encode` turns a stage payload into an :class:`Encoded`: a small msgpack *skeleton*
(msgspec) describing the structure, and a list of *buffers*, each the raw bytes of one
tensor or array, not copied. A connector moves ``Encoded.frames()`` as separate messages
(ZMQ with ``copy=False``) or writes :meth:`Encoded.pack_into` into one buffer (shared
memory: one copy per buffer). :func:`~vllm_kvbridge.wire.decode.decode_frames` /
:func:`~vllm_kvbridge.wire.decode.decode_packed` (:mod:`vllm_kvbridge.wire.decode`) invert
them, building tensors as views of the received buffers unless ``copy=True``.

Values: dict (str or int keys), list, tuple (comes back as a tuple; dict/list/tuple
subclasses come back as the base type), ``torch.Tensor`` and ``numpy.ndarray`` of an
allow-listed dtype (:mod:`vllm_kvbridge.wire.dtypes`), str, bytes, int (int64 range), float,
bool, None, and :class:`~vllm_kvbridge.wire.kv_format.KVCacheTransferData`. Anything else
raises :class:`PayloadError` naming the type and where it was found.

Skeleton (msgpack): ``["kvbw", 1, root]``, where ``root`` is the payload with these
explicit extension types (never a type guessed from dict keys):

* ext 1, torch tensor: data = msgpack ``[buffer index, dtype name, shape]``
* ext 2, numpy array: same data
* ext 3, tuple marker: empty data; only valid as the first element of an array, which
  then decodes as a tuple of the remaining elements
* ext 4, KVCacheTransferData: data = msgpack KV header
  (:class:`~vllm_kvbridge.wire.kv_format.KVHeader`) whose tensor ``offset`` fields are
  buffer indices

Every buffer must be referenced exactly once. GPU tensors are copied to the host once at
encode; decoded tensors are on the CPU. A :class:`~vllm_kvbridge.wire.fill.TensorFill`
encodes as a tensor whose values are written where the payload is packed (the KV gather;
a device tensor packed into device memory by :mod:`~vllm_kvbridge.wire.device_pack`,
decoded there by :func:`~vllm_kvbridge.wire.decode.decode_packed_device`).

Packed single-buffer layout (little-endian), written by :meth:`Encoded.pack_into`::

    offset       size   field
    0            4      magic b"KVBW"
    4            2      version (u16, 1)
    6            2      flags (u16, must be 0)
    8            4      n_buffers (u32)
    12           4      skeleton_len (u32)
    16           8      total_len (u64): bytes of the whole packed message
    24           16*n   frame table: n x (offset u64, nbytes u64), offsets from byte 0,
                        each a multiple of 64, increasing, non-overlapping
    24+16n       S      skeleton (S = skeleton_len)
    ...                 buffers at their table offsets; gaps are zero

A decoder accepts a buffer longer than ``total_len`` (pooled segments).

Limits (:class:`~vllm_kvbridge.wire.limits.Limits`) are enforced on encode and decode:
depth, item count (every value, container or scalar, counts one), buffer count, total
buffer bytes, ndim, skeleton size and string size. Sizes are checked against the actual
buffers before any tensor is built.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np
import torch

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire._buffers import (
    ALIGN,
    GIL_FREE_COPY,
    INT64_MAX,
    INT64_MIN,
    align_up,
    array_bytes,
    buffer_address,
    copy_many,
    dense_cpu,
    prepare_array,
    prepare_tensor,
    tensor_bytes,
    writable_byte_view,
)
from vllm_kvbridge.wire.dtypes import TORCH_DTYPE_NAMES
from vllm_kvbridge.wire.fill import TensorFill
from vllm_kvbridge.wire.kv_format import KVCacheTransferData
from vllm_kvbridge.wire.limits import DEFAULT_LIMITS, Limits

SKELETON_MAGIC = "kvbw"
PACKED_MAGIC = b"KVBW"
VERSION = 1

EXT_TENSOR = 1
EXT_NDARRAY = 2
EXT_TUPLE = 3
EXT_KV = 4

_PREFIX = struct.Struct("<4sHHIIQ")
PREFIX_SIZE = _PREFIX.size  # 24
_U32_MAX = (1 << 32) - 1
_ZEROS = bytes(ALIGN)
_Tensor = torch.Tensor

_encoder = msgspec.msgpack.Encoder()
_TUPLE_EXT = msgspec.msgpack.Ext(EXT_TUPLE, b"")


class _Fail(Exception):
    """Internal: a PayloadError message plus the path, built up while unwinding."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []


def _where(exc: _Fail) -> PayloadError:
    path = "".join(reversed(exc.path))
    return PayloadError(f"{exc.message} at payload{path}" if path else exc.message)


def _check_str(value: str | bytes, limits: Limits) -> None:
    n = len(value)
    if n > limits.max_str_bytes or (
        type(value) is str
        and n * 4 > limits.max_str_bytes
        and len(value.encode("utf-8", "surrogatepass")) > limits.max_str_bytes
    ):
        kind = "string" if type(value) is str else "bytes value"
        raise _Fail(f"{kind} exceeds max_str_bytes={limits.max_str_bytes}")


# -- encoding ----------------------------------------------------------------------------
class Encoded:
    """One encoded payload: a msgpack skeleton plus out-of-band buffers (one per tensor/array).

    ``buffers`` are flat ``'B'`` memoryviews over the tensors' own memory (CPU tensors are
    not copied; the views keep them alive). Mutating a source tensor before the payload is
    sent changes what is sent.

    Internally the buffers are kept as their *sources*: a dense CPU tensor itself (copied
    by :meth:`pack_into` straight from its ``data_ptr``), a memoryview, or a
    :class:`~vllm_kvbridge.wire.fill.TensorFill` (written by :meth:`pack_into` straight
    into the destination: the sender's one-copy path; materialized for ``buffers``). The memoryviews
    of ``buffers`` are built on first access, because building them costs more than the
    copy for small tensors and :meth:`pack_into` does not need them.
    """

    __slots__ = ("_buffers", "_layout", "_sizes", "_sources", "skeleton")

    def __init__(self, skeleton: bytes, buffers: list[memoryview]) -> None:
        self.skeleton = skeleton
        self._buffers: list[memoryview] | None = buffers
        self._sources: list[Any] = buffers
        self._sizes = [b.nbytes for b in buffers]
        self._layout: tuple[list[int], list[int], int] | None = None

    @classmethod
    def _from_sources(cls, skeleton: bytes, sources: list[Any], sizes: list[int]) -> Encoded:
        """``sizes``: the byte size of every source when it was encoded (what the skeleton says)."""
        enc = cls.__new__(cls)
        enc.skeleton = skeleton
        enc._buffers = None
        enc._sources = sources
        enc._sizes = sizes
        enc._layout = None
        return enc

    @property
    def buffers(self) -> list[memoryview]:
        """One flat ``'B'`` memoryview per tensor/array, in buffer-index order."""
        if self._buffers is None:
            self._buffers = [_source_bytes(s) for s in self._sources]
        return self._buffers

    @property
    def nbytes(self) -> int:
        """``len(skeleton)`` plus the size of every buffer."""
        return len(self.skeleton) + sum(self._table()[1])

    def frames(self) -> list[Any]:
        """``[skeleton, *buffers]``, the input of :func:`~vllm_kvbridge.wire.decode.decode_frames`."""
        return [self.skeleton, *self.buffers]

    def _table(self) -> tuple[list[int], list[int], int]:
        """``(offsets, sizes, total)`` of the packed layout (computed once)."""
        if self._layout is None:
            sizes = self._sizes
            offsets = []
            pos = align_up(PREFIX_SIZE + 16 * len(sizes) + len(self.skeleton))
            for size in sizes:
                offsets.append(pos)
                pos += size + (-size % ALIGN)  # every offset is aligned, so align the size
            total = offsets[-1] + sizes[-1] if sizes else PREFIX_SIZE + len(self.skeleton)
            self._layout = (offsets, sizes, total)
        return self._layout

    def packed_size(self) -> int:
        """Bytes :meth:`pack_into` writes."""
        return self._table()[2]

    def _head(self) -> bytes:
        offsets, sizes, total = self._table()
        n = len(sizes)
        table = np.empty(2 * n, dtype="<u8")
        table[0::2] = offsets
        table[1::2] = sizes
        prefix = _PREFIX.pack(PACKED_MAGIC, VERSION, 0, n, len(self.skeleton), total)
        return prefix + table.tobytes() + self.skeleton

    def pack_into(self, dst: Any, offset: int = 0) -> int:
        """Write the packed layout into ``dst[offset:]``, one copy per buffer; returns its size.

        ``dst``: any writable buffer (bytearray, memoryview, mmap, numpy uint8 array).
        Alignment is relative to ``offset``. Copies of 1 MiB and more release the GIL.
        Raises :class:`PayloadError` if ``dst`` is too small or read-only, or if a source
        tensor was resized since :func:`encode`.
        """
        offsets, sizes, total = self._table()
        mv = writable_byte_view(dst)
        if type(offset) is not int or offset < 0 or offset + total > len(mv):
            raise PayloadError(f"destination too small: need {total} bytes at offset {offset}, has {len(mv)}")
        region = mv[offset : offset + total]
        head = self._head()
        pos = len(head)
        region[:pos] = head
        base = buffer_address(region) if sizes else 0
        copies: list[tuple[int, int, int]] = []  # made together: see copy_many
        for index, (start, size, src) in enumerate(zip(offsets, sizes, self._sources)):
            if start > pos:
                region[pos:start] = _ZEROS[: start - pos]
            pos = start + size
            if type(src) is TensorFill:
                src.fill_bytes(region, start)
            elif type(src) is memoryview:
                if size < GIL_FREE_COPY:
                    region[start:pos] = src
                else:
                    copies.append((base + start, buffer_address(src), size))
            else:
                # A dense CPU tensor (encode checked it): copy from its current data_ptr,
                # after checking it still holds the bytes the table promises (bounds: the
                # region holds `total` bytes and the table keeps every buffer inside).
                # In-place ops (resize_, as_strided_, set_, .data=) can only change what
                # these three attributes report.
                if src.nbytes != size or not src.is_cpu or not src.is_contiguous():
                    raise PayloadError(f"buffer {index}: its tensor was changed in place after encode")
                copies.append((base + start, src.data_ptr(), size))
        copy_many(copies)
        return total

    def to_bytes(self) -> bytes:
        """The packed layout as ``bytes`` (one copy of each buffer)."""
        offsets, sizes, _ = self._table()
        head = self._head()
        pieces: list[Any] = [head]
        pos = len(head)
        for start, size, b in zip(offsets, sizes, self.buffers):
            pieces.append(_ZEROS[: start - pos])
            pieces.append(b)
            pos = start + size
        return b"".join(pieces)


def _source_bytes(source: Any) -> memoryview:
    """A buffer source (see :class:`Encoded`) as flat bytes."""
    if type(source) is memoryview:
        return source
    if type(source) is TensorFill:
        return tensor_bytes(prepare_tensor(source.materialize(), "tensor")[0])
    return tensor_bytes(source.detach())


class _EncodeWalk:
    __slots__ = ("items", "limits", "sizes", "sources", "total")

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.sources: list[Any] = []  # dense CPU tensors or memoryviews (see Encoded)
        self.sizes: list[int] = []
        self.items = 0
        self.total = 0

    def add_buffer(self, source: Any) -> int:
        if len(self.sources) >= self.limits.max_buffers:
            raise _Fail(f"more than max_buffers={self.limits.max_buffers} tensors/arrays")
        nbytes = source.nbytes
        self.total += nbytes
        if self.total > self.limits.max_total_bytes:
            raise _Fail(f"tensor/array bytes exceed max_total_bytes={self.limits.max_total_bytes}")
        self.sources.append(source)
        self.sizes.append(nbytes)
        return len(self.sources) - 1

    def tensor(self, obj: torch.Tensor) -> Any:
        if obj.dim() > self.limits.max_ndim:
            raise _Fail(f"tensor ndim {obj.dim()} exceeds max_ndim={self.limits.max_ndim}")
        name = TORCH_DTYPE_NAMES.get(obj.dtype)
        if name is not None and dense_cpu(obj):
            source: Any = obj  # no copy, no view: pack_into reads its data_ptr
        else:
            try:
                obj, name = prepare_tensor(obj, "tensor")
            except PayloadError as exc:
                raise _Fail(str(exc)) from None
            source = tensor_bytes(obj)
        index = self.add_buffer(source)
        return msgspec.msgpack.Ext(EXT_TENSOR, _encoder.encode((index, name, tuple(obj.shape))))

    def walk(self, obj: Any, depth: int) -> Any:
        self.items += 1
        if self.items > self.limits.max_items:
            raise _Fail(f"payload has more than max_items={self.limits.max_items} items")
        t = type(obj)
        if t is _Tensor:
            return self.tensor(obj)
        if t is str or t is bytes:
            _check_str(obj, self.limits)
            return obj
        if t is int:
            if not INT64_MIN <= obj <= INT64_MAX:
                raise _Fail(f"int {obj} does not fit in 64 bits")
            return obj
        if t is float or t is bool or obj is None:
            return obj
        if t is dict or t is list or t is tuple or isinstance(obj, dict | list | tuple):
            return self.container(obj, depth + 1)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if t is np.ndarray:
            if obj.ndim > self.limits.max_ndim:
                raise _Fail(f"array ndim {obj.ndim} exceeds max_ndim={self.limits.max_ndim}")
            try:
                arr, name = prepare_array(obj, "array")
            except PayloadError as exc:
                raise _Fail(str(exc)) from None
            index = self.add_buffer(array_bytes(arr))
            return msgspec.msgpack.Ext(EXT_NDARRAY, _encoder.encode((index, name, arr.shape)))
        if t is TensorFill:  # a tensor whose values are written where it is packed
            name = TORCH_DTYPE_NAMES.get(obj.dtype)
            if name is None or len(obj.shape) > self.limits.max_ndim:
                raise _Fail(f"unsupported fill of {obj.dtype} with shape {tuple(obj.shape)}")
            index = self.add_buffer(obj)
            return msgspec.msgpack.Ext(EXT_TENSOR, _encoder.encode((index, name, tuple(obj.shape))))
        if isinstance(obj, KVCacheTransferData):
            try:
                raw, sources = obj._codec_encode(self.limits, len(self.sources))
            except PayloadError as exc:
                raise _Fail(str(exc)) from None
            for source in sources:
                self.add_buffer(source)
            return msgspec.msgpack.Ext(EXT_KV, raw)
        raise _Fail(f"unsupported type {t.__module__}.{t.__qualname__}")

    def container(self, obj: Any, depth: int) -> Any:
        if depth > self.limits.max_depth:
            raise _Fail(f"nesting exceeds max_depth={self.limits.max_depth}")
        walk = self.walk
        if isinstance(obj, dict):
            out = {}
            for key, value in obj.items():
                kt = type(key)
                if not (kt is str or (kt is int and INT64_MIN <= key <= INT64_MAX)):
                    raise _Fail(f"dict key {key!r} ({kt.__name__}) is not a str or int64")
                try:
                    out[key] = walk(value, depth)
                except _Fail as exc:
                    exc.path.append(f"[{key!r}]")
                    raise
            return out
        out_list: list[Any] = [_TUPLE_EXT] if isinstance(obj, tuple) else []
        for i, value in enumerate(obj):
            try:
                out_list.append(walk(value, depth))
            except _Fail as exc:
                exc.path.append(f"[{i}]")
                raise
        return out_list


def encode(obj: Any, *, limits: Limits | None = None) -> Encoded:
    """Encode a payload without copying tensor bytes (see the module docstring).

    Raises :class:`PayloadError` for unsupported values or anything over ``limits``.
    """
    limits = limits or DEFAULT_LIMITS
    walker = _EncodeWalk(limits)
    try:
        root = walker.walk(obj, 0)
    except _Fail as exc:
        raise _where(exc) from None
    try:
        skeleton = _encoder.encode([SKELETON_MAGIC, VERSION, root])
    except (msgspec.EncodeError, UnicodeEncodeError, OverflowError) as exc:
        raise PayloadError(f"payload cannot be encoded: {exc}") from None
    if len(skeleton) > min(limits.max_skeleton_bytes, _U32_MAX):
        raise PayloadError(f"skeleton of {len(skeleton)} bytes exceeds max_skeleton_bytes")
    return Encoded._from_sources(skeleton, walker.sources, walker.sizes)
