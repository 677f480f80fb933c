"""Byte-level helpers of the payload codec (and of the KV container it carries).

Contracts:
  * :func:`byte_view` turns anything with the buffer protocol into a flat ``'B'``
    memoryview without copying, or raises :class:`PayloadError`.
  * :func:`tensor_bytes` / :func:`array_bytes` expose the bytes of a tensor/array as a
    flat memoryview; only non-contiguous or non-CPU inputs are copied (once).
  * :func:`check_shape` validates a wire shape against a byte count *before* anything
    is allocated; :func:`tensor_from_view` / :func:`array_from_view` then build a
    zero-copy view (or one copy when asked). :func:`check_wire_shape` is the same check,
    memoised, for shapes that come out of a typed msgspec decode.
  * :class:`OutOfBand` is the set of out-of-band buffers of one decoded message (separate
    frames, or slices of one packed buffer); it builds the typed views.
  * :func:`dense_cpu` / :func:`copy_bytes`: the encode-side fast path (a dense CPU tensor
    is copied straight from its ``data_ptr``, no intermediate views).

Why the views are built the way they are: on CPU every torch op costs microseconds of
dispatch, so a payload of many small tensors (a KV cache: 2 x layers tensors) is
dominated by per-tensor overhead, not by bytes. A packed buffer is therefore wrapped
with one ``torch.frombuffer`` and one typed view per dtype, and each tensor is a single
``as_strided`` of that view (one op instead of three), with strides computed once per
shape.

Read-only buffers: torch has no read-only tensors, so a tensor decoded from a read-only
buffer (``bytes``, a read-only mmap, a ZMQ frame) is writable in torch's eyes. Writing
into it is undefined behaviour; decode with ``copy=True`` to get tensors you may modify.
torch warns about this once per process ("The given buffer is not writable"); we
trigger and silence that one-time warning at import, because every zero-copy decode of
a received frame would otherwise emit it and the contract above already documents it.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import numpy as np
import torch

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire import parallel_copy
from vllm_kvbridge.wire.dtypes import (
    ITEMSIZE,
    NUMPY_DTYPE_NAMES,
    NUMPY_DTYPES,
    TORCH_DTYPE_NAMES,
    TORCH_DTYPES,
)
from vllm_kvbridge.wire.limits import Limits

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
#: Buffer offsets in the packed layout are multiples of this (cache line, and a
#: multiple of every itemsize, so typed views never straddle an alignment boundary).
ALIGN = 64
_EMPTY = memoryview(b"")
#: Copies at least this big release the GIL (``ctypes.memmove``) so other threads keep
#: running; smaller ones keep it, since handing the GIL over and waiting to get it back
#: can cost a whole switch interval (5 ms) when another thread is busy.
GIL_FREE_COPY = 1 << 20


def _libc_memmove(dll: ctypes.CDLL) -> Any:
    fn = dll.memmove
    fn.restype = None  # the return value is dst; not converting it saves time per call
    fn.argtypes = (ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t)
    return fn


# PyDLL functions run with the GIL held; ctypes.memmove (a CFUNCTYPE) releases it.
_memmove_holding_gil = _libc_memmove(ctypes.PyDLL(None))

with warnings.catch_warnings():
    # Consume torch's warn-once about non-writable buffers (see module docstring).
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def align_up(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def byte_view(obj: Any, what: str = "buffer") -> memoryview:
    """A flat, C-contiguous ``'B'`` memoryview of ``obj`` (no copy)."""
    if type(obj) is memoryview:
        mv = obj
    else:
        try:
            mv = memoryview(obj)
        except TypeError:
            raise PayloadError(
                f"{what} of type {type(obj).__name__} does not support the buffer protocol"
            ) from None
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    if not mv.c_contiguous:
        raise PayloadError(f"{what} is not C-contiguous")
    try:
        return mv.cast("B")
    except (TypeError, ValueError):
        # Formats memoryview cannot cast directly (e.g. numpy complex) go through numpy.
        try:
            return memoryview(np.frombuffer(mv, dtype=np.uint8))
        except (TypeError, ValueError) as exc:
            raise PayloadError(f"{what} cannot be viewed as bytes: {exc}") from None


def writable_byte_view(obj: Any, what: str = "destination") -> memoryview:
    mv = byte_view(obj, what)
    if mv.readonly:
        raise PayloadError(f"{what} is read-only")
    return mv


def dense_cpu(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes are ``t.nbytes`` contiguous bytes at ``t.data_ptr()`` in host memory.

    Only plain ``torch.Tensor`` objects qualify (subclasses may redefine any of these
    attributes); everything else goes through :func:`prepare_tensor`.
    """
    return (
        type(t) is torch.Tensor
        and t.is_cpu
        and t.layout == torch.strided
        and not t.is_nested
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """``memmove(dst, src, nbytes)``; the caller has checked both ranges.

    Large copies release the GIL (see :data:`GIL_FREE_COPY`) and the largest run on
    several threads (:mod:`vllm_kvbridge.wire.parallel_copy`); small ones keep the GIL.
    """
    if nbytes >= GIL_FREE_COPY:
        parallel_copy.memmove(dst, src, nbytes)
    elif nbytes:
        _memmove_holding_gil(dst, src, nbytes)


def copy_many(copies: list[tuple[int, int, int]]) -> None:
    """:func:`copy_bytes` for every ``(dst, src, nbytes)``; non-overlapping destinations.

    A payload's buffers are packed with one call: together they are often big where each
    is not, and :func:`~vllm_kvbridge.wire.parallel_copy.memmove_many` then spreads their
    bytes over several threads.
    """
    if sum(n for _, _, n in copies) >= parallel_copy.PARALLEL_COPY:
        parallel_copy.memmove_many(copies)
        return
    for dst, src, nbytes in copies:
        copy_bytes(dst, src, nbytes)


def buffer_address(mv: memoryview) -> int:
    """Address of the first byte of a non-empty flat byte memoryview."""
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


def prepare_tensor(t: torch.Tensor, what: str) -> tuple[torch.Tensor, str]:
    """A dense, CPU-resident tensor equal to ``t`` and its wire dtype name.

    Copies only when needed: a GPU tensor is copied to the host once (made contiguous on
    its device first), a non-contiguous CPU tensor is made contiguous once.
    """
    name = TORCH_DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise PayloadError(f"{what}: dtype {t.dtype} is not in the wire allow-list")
    if t.layout != torch.strided:
        raise PayloadError(f"{what}: only dense (strided) tensors are supported, got {t.layout}")
    if t.device.type == "meta":
        raise PayloadError(f"{what}: meta tensors have no data")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t, name


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Bytes of a dense contiguous CPU tensor (from :func:`prepare_tensor`), no copy.

    The memoryview keeps the tensor alive (through the numpy array it wraps).
    """
    if t.numel() == 0:
        return _EMPTY
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def prepare_array(a: np.ndarray, what: str) -> tuple[np.ndarray, str]:
    """A C-contiguous native-byte-order array equal to ``a`` and its wire dtype name."""
    dt = a.dtype
    if dt.byteorder == ">" or (dt.byteorder == "<" and not np.little_endian):
        dt = dt.newbyteorder("=")
        if dt in NUMPY_DTYPE_NAMES:
            a = a.astype(dt)
    name = NUMPY_DTYPE_NAMES.get(dt)
    if name is None:
        raise PayloadError(f"{what}: numpy dtype {a.dtype} is not in the wire allow-list")
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a, name


def array_bytes(a: np.ndarray) -> memoryview:
    if a.size == 0:
        return _EMPTY
    return memoryview(a.reshape(-1).view(np.uint8))


def check_shape(shape: Any, dtype: str, nbytes: int, limits: Limits, what: str) -> tuple[int, ...]:
    """Validate a wire shape for ``nbytes`` bytes of ``dtype``; returns it as a tuple.

    Runs before any allocation: ndim against the limit, every dim a non-negative int64,
    and ``prod(shape) * itemsize == nbytes`` exactly.
    """
    itemsize = ITEMSIZE.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise PayloadError(f"{what}: dtype {dtype!r} is not in the wire allow-list")
    if type(shape) not in (list, tuple):
        raise PayloadError(f"{what}: shape must be a list of ints, got {type(shape).__name__}")
    if len(shape) > limits.max_ndim:
        raise PayloadError(f"{what}: ndim {len(shape)} exceeds max_ndim={limits.max_ndim}")
    numel = 1
    extent = itemsize  # bytes spanned if zero dims were 1: torch/numpy stride math must fit int64
    for dim in shape:
        if type(dim) is not int or dim < 0 or dim > INT64_MAX:
            raise PayloadError(f"{what}: bad dimension {dim!r} in shape {list(shape)!r}")
        numel *= dim
        extent *= dim or 1
    if extent > INT64_MAX:
        raise PayloadError(f"{what}: shape {list(shape)!r} overflows int64 strides")
    if numel * itemsize != nbytes:
        raise PayloadError(
            f"{what}: shape {list(shape)} x {dtype} needs {numel * itemsize} bytes, buffer has {nbytes}"
        )
    return tuple(shape)


_SHAPE_CACHE: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
_SHAPE_CACHE_MAX = 4096


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    strides = []
    step = 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim or 1
    return tuple(reversed(strides))


def check_wire_shape(
    shape: list[int], dtype: str, nbytes: int, limits: Limits, what: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """:func:`check_shape` memoised, plus the contiguous strides: ``(shape, strides)``.

    Only for values from a typed msgspec decode (``shape`` a list of ints, never bools,
    ``dtype`` a str, ``nbytes`` an int), which is what makes the cache key exact: a
    payload of many same-shaped tensors (a KV cache) validates each shape once. Failures
    are not cached, so every bad shape raises the same error as :func:`check_shape`.
    """
    key = (dtype, nbytes, limits.max_ndim, *shape)
    hit = _SHAPE_CACHE.get(key)
    if hit is not None:
        return hit
    checked = check_shape(shape, dtype, nbytes, limits, what)
    if len(_SHAPE_CACHE) >= _SHAPE_CACHE_MAX:
        _SHAPE_CACHE.clear()
    result = _SHAPE_CACHE[key] = (checked, contiguous_strides(checked))
    return result


def _check_bool_bytes(u8: np.ndarray | torch.Tensor, what: str) -> None:
    # torch/numpy assume bool bytes are 0 or 1; other values give inconsistent results.
    size = u8.numel() if isinstance(u8, torch.Tensor) else u8.size
    if size and int(u8.max()) > 1:
        raise PayloadError(f"{what}: bool data holds bytes other than 0 and 1")


def tensor_from_view(
    mv: memoryview,
    dtype: str,
    shape: tuple[int, ...],
    copy: bool,
    what: str,
    strides: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A tensor over ``mv`` (already validated by :func:`check_shape`); zero-copy unless ``copy``.

    ``strides``: the contiguous strides of ``shape`` when the caller has them.
    """
    torch_dtype = TORCH_DTYPES[dtype]
    if len(mv) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if dtype == "bool":
        _check_bool_bytes(np.frombuffer(mv, dtype=np.uint8), what)
    t = torch.frombuffer(mv, dtype=torch_dtype)
    if len(shape) != 1:
        t = t.as_strided(shape, strides if strides is not None else contiguous_strides(shape))
    return t.clone() if copy else t


def array_from_view(mv: memoryview, dtype: str, shape: tuple[int, ...], copy: bool, what: str) -> np.ndarray:
    np_dtype = NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        raise PayloadError(f"{what}: dtype {dtype!r} is not available for numpy arrays")
    if len(mv) == 0:
        return np.empty(shape, dtype=np_dtype)
    if dtype == "bool":
        _check_bool_bytes(np.frombuffer(mv, dtype=np.uint8), what)
    a = np.frombuffer(mv, dtype=np_dtype).reshape(shape)
    return a.copy() if copy else a


class OutOfBand:
    """The out-of-band buffers of one decoded message, and typed views of them.

    Either separate frames (:meth:`from_frames`) or byte ranges of one packed buffer
    (:meth:`from_packed`). ``sizes[i]`` is the byte length of buffer ``i``. The caller
    validates shapes against ``sizes`` (and, for packed buffers, every range against the
    buffer and alignment to :data:`ALIGN`) before asking for a view.

    Packed buffers get one ``torch.frombuffer`` for the whole buffer and one typed view
    per dtype; each tensor is then one ``as_strided`` of it (see the module docstring).
    Every tensor shares the buffer's storage, which keeps the buffer alive exactly as a
    per-tensor ``frombuffer`` would.
    """

    __slots__ = ("_frames", "_mv", "_starts", "_typed", "_u8", "sizes")

    def __init__(
        self, frames: list[memoryview] | None, mv: memoryview | None, starts: list[int], sizes: list[int]
    ) -> None:
        self._frames = frames
        self._mv = mv
        self._starts = starts
        self.sizes = sizes
        self._u8: torch.Tensor | None = None
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def from_frames(cls, frames: list[memoryview]) -> OutOfBand:
        return cls(frames, None, [], [len(f) for f in frames])

    @classmethod
    def from_packed(cls, mv: memoryview, starts: list[int], sizes: list[int]) -> OutOfBand:
        """Buffer ``i`` is ``mv[starts[i] : starts[i] + sizes[i]]``; starts are ALIGN-aligned."""
        return cls(None, mv, starts, sizes)

    @classmethod
    def from_device(cls, data: torch.Tensor, starts: list[int], sizes: list[int]) -> OutOfBand:
        """As :meth:`from_packed`, over a contiguous 1-D uint8 tensor on any device whose
        storage offset is ALIGN-aligned: tensors are views of it, on its device."""
        oob = cls(None, None, starts, sizes)
        oob._u8 = data
        return oob

    def __len__(self) -> int:
        return len(self.sizes)

    def _typed_view(self, torch_dtype: torch.dtype, itemsize: int) -> torch.Tensor:
        typed = self._typed.get(torch_dtype)
        if typed is None:
            if self._u8 is None:
                self._u8 = torch.frombuffer(self._mv, dtype=torch.uint8)
            usable = len(self._u8) - len(self._u8) % itemsize
            typed = self._typed[torch_dtype] = self._u8[:usable].view(torch_dtype)
        return typed

    def tensor(
        self,
        i: int,
        dtype: str,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        copy: bool,
        what: str,
    ) -> torch.Tensor:
        """Buffer ``i`` as a tensor of ``dtype``/``shape`` (checked by :func:`check_wire_shape`)."""
        if self._frames is not None:
            return tensor_from_view(self._frames[i], dtype, shape, copy, what, strides)
        torch_dtype = TORCH_DTYPES[dtype]
        nbytes = self.sizes[i]
        if nbytes == 0:
            return torch.empty(
                shape, dtype=torch_dtype, device=self._u8.device if self._mv is None else "cpu"
            )
        start = self._starts[i]
        if dtype == "bool":
            if self._mv is None:
                _check_bool_bytes(self._u8[start : start + nbytes], what)
            else:
                _check_bool_bytes(np.frombuffer(self._mv, dtype=np.uint8, count=nbytes, offset=start), what)
        itemsize = ITEMSIZE[dtype]
        # start is ALIGN-aligned, so a multiple of every itemsize: the element offset is exact.
        t = self._typed_view(torch_dtype, itemsize).as_strided(shape, strides, start // itemsize)
        return t.clone() if copy else t

    def array(self, i: int, dtype: str, shape: tuple[int, ...], copy: bool, what: str) -> np.ndarray:
        """Buffer ``i`` as a numpy array of ``dtype``/``shape`` (checked by :func:`check_shape`)."""
        if self._frames is not None:
            return array_from_view(self._frames[i], dtype, shape, copy, what)
        start = self._starts[i]
        if self._mv is None:  # device bytes: numpy lives on the host
            host = self._u8[start : start + self.sizes[i]].cpu().numpy()
            return array_from_view(memoryview(host), dtype, shape, False, what)
        return array_from_view(self._mv[start : start + self.sizes[i]], dtype, shape, copy, what)


def tensors_bitwise_equal(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are tensors (or arrays) of the same type, dtype, shape and bytes.

    Compares raw bytes, so NaN payloads and -0.0 count as equal only to themselves.
    """
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a_bytes = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        b_bytes = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return bool(torch.equal(a_bytes, b_bytes))
    if type(a) is np.ndarray and type(b) is np.ndarray:
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
        )
    return False
