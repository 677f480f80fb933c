"""The payload codec: a msgpack skeleton plus one out-of-band buffer per tensor/array.

:func:`encode` turns a stage payload into an :class:`Encoded`: a small msgpack *skeleton*
(msgspec) describing the structure, and a list of *buffers*, each the raw bytes of one
tensor or array, not copied. A connector moves ``Encoded.frames()`` as separate messages
(ZMQ with ``copy=False``) or writes :meth:`Encoded.pack_into` into one buffer (shared
memory: one copy per buffer). :func:`decode_frames` / :func:`decode_packed` invert them,
building tensors as views of the received buffers unless ``copy=True``.

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
encode; decoded tensors are on the CPU.

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
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire import kv_format
from vllm_kvbridge.wire._buffers import (
    ALIGN,
    GIL_FREE_COPY,
    INT64_MAX,
    INT64_MIN,
    OutOfBand,
    align_up,
    array_bytes,
    buffer_address,
    byte_view,
    check_wire_shape,
    copy_bytes,
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
        """``[skeleton, *buffers]``, the input of :func:`decode_frames`."""
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
                    copy_bytes(base + start, buffer_address(src), size)
            else:
                # A dense CPU tensor (encode checked it): copy from its current data_ptr,
                # after checking it still holds the bytes the table promises (bounds: the
                # region holds `total` bytes and the table keeps every buffer inside).
                # In-place ops (resize_, as_strided_, set_, .data=) can only change what
                # these three attributes report.
                if src.nbytes != size or not src.is_cpu or not src.is_contiguous():
                    raise PayloadError(f"buffer {index}: its tensor was changed in place after encode")
                copy_bytes(base + start, src.data_ptr(), size)
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


# -- decoding ----------------------------------------------------------------------------
class _ArrayRef:
    """A tensor/array reference parsed from an ext, resolved against the frames later."""

    __slots__ = ("code", "dtype", "index", "shape")

    def __init__(self, code: int, index: Any, dtype: Any, shape: Any) -> None:
        self.code, self.index, self.dtype, self.shape = code, index, dtype, shape


class _KVRef:
    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


class _TupleMark:
    __slots__ = ()


_TUPLE_MARK = _TupleMark()
_ref_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[int]])


def _ext_hook(code: int, data: memoryview) -> Any:
    # Runs inside msgspec's decode; `data` is only valid during this call, so copy what we keep.
    if code in (EXT_TENSOR, EXT_NDARRAY):
        try:
            index, dtype, shape = _ref_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PayloadError(f"malformed tensor reference: {exc}") from None
        return _ArrayRef(code, index, dtype, shape)
    if code == EXT_TUPLE:
        if len(data):
            raise PayloadError("malformed tuple tag: non-empty data")
        return _TUPLE_MARK
    if code == EXT_KV:
        return _KVRef(bytes(data))
    raise PayloadError(f"unknown extension type {code}")


_skeleton_decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


class _DecodeWalk:
    __slots__ = ("copy", "frames", "items", "limits", "used")

    def __init__(self, frames: OutOfBand, limits: Limits, copy: bool) -> None:
        self.frames = frames
        self.limits = limits
        self.copy = copy
        self.items = 0
        self.used = bytearray(len(frames))

    def build(self, node: Any, depth: int) -> Any:
        self.items += 1
        if self.items > self.limits.max_items:
            raise _Fail(f"payload has more than max_items={self.limits.max_items} items")
        t = type(node)
        if t is _ArrayRef:
            return self.array(node)
        if t is str or t is bytes:
            _check_str(node, self.limits)
            return node
        if t is int:
            if node > INT64_MAX:
                raise _Fail(f"int {node} does not fit in int64")
            return node
        if t is float or t is bool or node is None:
            return node
        if t is list or t is dict:
            depth += 1
            if depth > self.limits.max_depth:
                raise _Fail(f"nesting exceeds max_depth={self.limits.max_depth}")
            build = self.build
            if t is dict:
                for key, value in node.items():
                    kt = type(key)
                    if not (kt is str or (kt is int and key <= INT64_MAX)):
                        raise _Fail(f"dict key of type {kt.__name__} (only str and int64 keys are allowed)")
                    try:
                        node[key] = build(value, depth)
                    except _Fail as exc:
                        exc.path.append(f"[{key!r}]")
                        raise
                return node
            is_tuple = bool(node) and node[0] is _TUPLE_MARK
            for i in range(1 if is_tuple else 0, len(node)):
                try:
                    node[i] = build(node[i], depth)
                except _Fail as exc:
                    exc.path.append(f"[{i - is_tuple}]")
                    raise
            return tuple(node[1:]) if is_tuple else node
        if t is _KVRef:
            try:
                return kv_format.codec_decode(node.raw, self.frames, self.used, self.limits, self.copy)
            except PayloadError as exc:
                raise _Fail(str(exc)) from None
        if t is _TupleMark:
            raise _Fail("tuple tag outside the first position of an array")
        # e.g. datetime from msgpack's timestamp extension, or tuple keys.
        raise _Fail(f"unexpected decoded type {t.__name__}")

    def array(self, ref: _ArrayRef) -> Any:
        what = "tensor" if ref.code == EXT_TENSOR else "array"
        index = ref.index
        frames = self.frames
        if not 0 <= index < len(frames):
            raise _Fail(f"{what} buffer index {index} out of range ({len(frames)} buffers)")
        if self.used[index]:
            raise _Fail(f"{what} buffer {index} is referenced twice")
        self.used[index] = 1
        try:
            # ref comes from a typed decode (int, str, list[int]): the memoised check applies.
            shape, strides = check_wire_shape(ref.shape, ref.dtype, frames.sizes[index], self.limits, what)
            if ref.code == EXT_TENSOR:
                return frames.tensor(index, ref.dtype, shape, strides, self.copy, what)
            return frames.array(index, ref.dtype, shape, self.copy, what)
        except PayloadError as exc:
            raise _Fail(str(exc)) from None


def _decode(skeleton: memoryview, buffers: OutOfBand, limits: Limits, copy: bool) -> Any:
    if len(skeleton) > limits.max_skeleton_bytes:
        raise PayloadError(f"skeleton of {len(skeleton)} bytes exceeds max_skeleton_bytes")
    try:
        top = _skeleton_decoder.decode(skeleton)
    except msgspec.DecodeError as exc:
        raise PayloadError(f"malformed skeleton: {exc}") from None
    except RecursionError:
        raise PayloadError("malformed skeleton: nesting too deep") from None
    except (TypeError, ValueError) as exc:  # e.g. an unhashable map key; PayloadError is a ValueError
        if isinstance(exc, PayloadError):
            raise
        raise PayloadError(f"malformed skeleton: {exc}") from None
    if type(top) is not list or len(top) != 3 or top[0] != SKELETON_MAGIC:
        raise PayloadError("not a payload skeleton (bad magic)")
    if top[1] != VERSION:
        raise PayloadError(f"unsupported payload version {top[1]!r} (this build reads {VERSION})")
    walker = _DecodeWalk(buffers, limits, copy)
    try:
        result = walker.build(top[2], 0)
    except _Fail as exc:
        raise _where(exc) from None
    if not all(walker.used):
        raise PayloadError(f"buffer {walker.used.index(0)} is not referenced by the skeleton")
    return result


def decode_frames(frames: Sequence[Any], *, limits: Limits | None = None, copy: bool = False) -> Any:
    """Decode ``[skeleton, *buffers]`` (as from :meth:`Encoded.frames`).

    Frames may be any buffer-protocol objects (bytes, memoryview, ``zmq.Frame``). Tensors
    and arrays are views of the frames unless ``copy``; see
    :mod:`vllm_kvbridge.wire._buffers` about read-only frames.
    """
    limits = limits or DEFAULT_LIMITS
    try:
        n = len(frames)
    except TypeError:
        raise PayloadError(f"frames must be a sequence, got {type(frames).__name__}") from None
    if n == 0:
        raise PayloadError("no frames: a payload needs at least the skeleton frame")
    if n - 1 > limits.max_buffers:
        raise PayloadError(f"{n - 1} buffers exceed max_buffers={limits.max_buffers}")
    skeleton = byte_view(frames[0], "skeleton frame")
    buffers = OutOfBand.from_frames([byte_view(frames[i], f"frame {i}") for i in range(1, n)])
    total = sum(buffers.sizes)
    if total > limits.max_total_bytes:
        raise PayloadError(f"buffers hold {total} bytes, over max_total_bytes={limits.max_total_bytes}")
    return _decode(skeleton, buffers, limits, copy)


def decode_packed(buffer: Any, *, limits: Limits | None = None, copy: bool = False) -> Any:
    """Decode the packed layout written by :meth:`Encoded.pack_into`.

    ``buffer`` may be longer than the message. Every size and offset is checked against
    ``len(buffer)`` and ``limits`` before use.
    """
    limits = limits or DEFAULT_LIMITS
    mv, skeleton, starts, sizes = _parse_packed(buffer, limits)
    return _decode(skeleton, OutOfBand.from_packed(mv, starts, sizes), limits, copy)


def packed_frames(buffer: Any, *, limits: Limits | None = None) -> list[memoryview]:
    """The frames (skeleton, then every buffer) of a packed payload as views of ``buffer``,
    no copy: what :func:`decode_frames` reads, e.g. to send a packed payload as ZMQ frames.
    The table is checked as :func:`decode_packed` checks it."""
    mv, skeleton, starts, sizes = _parse_packed(buffer, limits or DEFAULT_LIMITS)
    return [skeleton, *(mv[start : start + size] for start, size in zip(starts, sizes))]


def _parse_packed(buffer: Any, limits: Limits) -> tuple[memoryview, memoryview, list[int], list[int]]:
    """``(bytes, skeleton, buffer starts, buffer sizes)`` of a packed payload, checked."""
    mv = byte_view(buffer, "packed payload")
    length = len(mv)
    if length < PREFIX_SIZE:
        raise PayloadError(f"packed payload truncated: {length} bytes < {PREFIX_SIZE}-byte prefix")
    magic, version, flags, n, skeleton_len, total = _PREFIX.unpack_from(mv, 0)
    if magic != PACKED_MAGIC:
        hint = " (a packed KV buffer: use KVCacheTransferData.from_bytes)" if magic == kv_format.MAGIC else ""
        raise PayloadError(f"bad magic {bytes(magic)!r}: not a packed payload{hint}")
    if version != VERSION:
        raise PayloadError(f"unsupported packed payload version {version} (this build reads {VERSION})")
    if flags:
        raise PayloadError(f"reserved flags must be 0, got {flags}")
    if n > limits.max_buffers:
        raise PayloadError(f"{n} buffers exceed max_buffers={limits.max_buffers}")
    if skeleton_len > limits.max_skeleton_bytes:
        raise PayloadError(f"skeleton of {skeleton_len} bytes exceeds max_skeleton_bytes")
    if total > length:
        raise PayloadError(f"packed payload truncated: header says {total} bytes, buffer has {length}")
    table_end = PREFIX_SIZE + 16 * n
    pos = table_end + skeleton_len
    if pos > total:
        raise PayloadError(f"frame table and skeleton ({pos} bytes) overrun total_len {total}")
    table = np.frombuffer(mv, dtype="<u8", count=2 * n, offset=PREFIX_SIZE)
    starts: list[int] = table[0::2].tolist()
    sizes: list[int] = table[1::2].tolist()
    if not _table_ok(starts, sizes, pos, total, limits):
        _check_table(starts, sizes, pos, total, limits)  # raises, naming the first bad entry
    return mv, mv[table_end:pos], starts, sizes


def _table_ok(starts: list[int], sizes: list[int], pos: int, total: int, limits: Limits) -> bool:
    """True when :func:`_check_table` would pass (a fast test of the same rules).

    One Python pass of integer arithmetic, no f-strings or per-entry branches beyond the
    comparisons; ``_check_table`` runs only to name the problem when this says no.
    """
    if sum(sizes) > limits.max_total_bytes:
        return False
    for start, size in zip(starts, sizes):
        if start & (ALIGN - 1) or start < pos or size > total - start:
            return False
        pos = start + size
    return True


def _check_table(starts: list[int], sizes: list[int], pos: int, total: int, limits: Limits) -> None:
    """Validate the frame table entry by entry; raise PayloadError naming the first bad one.

    The scalar form of :func:`_table_ok`: it decides whenever the fast test says no.
    """
    nbytes_sum = 0
    for i, (start, size) in enumerate(zip(starts, sizes)):
        if start % ALIGN:
            raise PayloadError(f"buffer {i}: offset {start} is not {ALIGN}-byte aligned")
        if start < pos:
            raise PayloadError(f"buffer {i}: offset {start} overlaps the skeleton or buffer {i - 1}")
        if size > total - start:
            raise PayloadError(f"buffer {i}: bytes [{start}, {start + size}) outside total_len {total}")
        nbytes_sum += size
        if nbytes_sum > limits.max_total_bytes:
            raise PayloadError(f"buffers exceed max_total_bytes={limits.max_total_bytes}")
        pos = start + size
