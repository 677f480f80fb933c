"""Decoding of the payload codec (:mod:`vllm_kvbridge.wire.codec`, which describes the format).

:func:`decode_frames` and :func:`decode_packed` invert :meth:`Encoded.frames
<vllm_kvbridge.wire.codec.Encoded.frames>` and :meth:`Encoded.pack_into
<vllm_kvbridge.wire.codec.Encoded.pack_into>`, building tensors as views of the received
buffers unless ``copy=True``; :func:`packed_frames` serves a packed buffer's frames as
views. Every size is checked against the actual buffers before any tensor is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire._buffers import ALIGN, INT64_MAX, OutOfBand, byte_view, check_wire_shape
from vllm_kvbridge.wire.codec import (
    _PREFIX,
    EXT_KV,
    EXT_NDARRAY,
    EXT_TENSOR,
    EXT_TUPLE,
    PACKED_MAGIC,
    PREFIX_SIZE,
    SKELETON_MAGIC,
    VERSION,
    _check_str,
    _Fail,
    _where,
)
from vllm_kvbridge.wire.kv_format import codec_decode
from vllm_kvbridge.wire.limits import DEFAULT_LIMITS, Limits


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
                return codec_decode(node.raw, self.frames, self.used, self.limits, self.copy)
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


def decode_packed_device(
    head: Any, data: torch.Tensor, *, limits: Limits | None = None, copy: bool = False
) -> Any:
    """Decode a payload packed into ``data`` (a contiguous 1-D uint8 tensor on any device:
    :func:`~vllm_kvbridge.wire.device_pack.pack_into_device`) whose head (prefix, table,
    skeleton) is ``head``, a host copy of its first bytes. Tensors are views of ``data``
    (copies with ``copy``), on its device; numpy arrays are copied to the host. The table
    is checked against ``data.numel()`` as :func:`decode_packed` checks it."""
    limits = limits or DEFAULT_LIMITS
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise PayloadError(f"packed device payload must be a 1-D uint8 tensor, got {type(data).__name__}")
    if not data.is_contiguous() or data.storage_offset() % ALIGN:
        data = data.contiguous().clone()  # typed views need ALIGN-aligned starts
    _, skeleton, starts, sizes = _parse_packed(head, limits, length=data.numel())
    return _decode(skeleton, OutOfBand.from_device(data, starts, sizes), limits, copy)


def _parse_packed(
    buffer: Any, limits: Limits, *, length: int | None = None
) -> tuple[memoryview, memoryview, list[int], list[int]]:
    """``(bytes, skeleton, buffer starts, buffer sizes)`` of a packed payload, checked;
    ``length``: the whole payload's bytes where ``buffer`` holds only its head."""
    mv = byte_view(buffer, "packed payload")
    length = len(mv) if length is None else length
    if length < PREFIX_SIZE:
        raise PayloadError(f"packed payload truncated: {length} bytes < {PREFIX_SIZE}-byte prefix")
    if len(mv) < PREFIX_SIZE:  # only a head was given (decode_packed_device), and it is short
        raise PayloadError(f"packed payload head truncated: {len(mv)} bytes < {PREFIX_SIZE}-byte prefix")
    magic, version, flags, n, skeleton_len, total = _PREFIX.unpack_from(mv, 0)
    if magic != PACKED_MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r}: not a packed payload")
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
    if pos > len(mv):  # only a head was given, and it is short
        raise PayloadError(f"packed payload head truncated: {len(mv)} bytes < {pos}")
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
