"""Byte-level helpers shared by the payload codec and the packed KV format.

Contracts:
  * :func:`byte_view` turns anything with the buffer protocol into a flat ``'B'``
    memoryview without copying, or raises :class:`PayloadError`.
  * :func:`tensor_bytes` / :func:`array_bytes` expose the bytes of a tensor/array as a
    flat memoryview; only non-contiguous or non-CPU inputs are copied (once).
  * :func:`check_shape` validates a wire shape against a byte count *before* anything
    is allocated; :func:`tensor_from_view` / :func:`array_from_view` then build a
    zero-copy view (or one copy when asked).

Read-only buffers: torch has no read-only tensors, so a tensor decoded from a read-only
buffer (``bytes``, a read-only mmap, a ZMQ frame) is writable in torch's eyes. Writing
into it is undefined behaviour; decode with ``copy=True`` to get tensors you may modify.
torch warns about this once per process ("The given buffer is not writable"); we
trigger and silence that one-time warning at import, because every zero-copy decode of
a received frame would otherwise emit it and the contract above already documents it.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from vllm_kvbridge.errors import PayloadError
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
#: Data offsets in both packed layouts are multiples of this (cache line, and a
#: multiple of every itemsize, so typed views never straddle an alignment boundary).
ALIGN = 64
_EMPTY = memoryview(b"")

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


def _check_bool_bytes(u8: np.ndarray | torch.Tensor, what: str) -> None:
    # torch/numpy assume bool bytes are 0 or 1; other values give inconsistent results.
    size = u8.numel() if isinstance(u8, torch.Tensor) else u8.size
    if size and int(u8.max()) > 1:
        raise PayloadError(f"{what}: bool data holds bytes other than 0 and 1")


def tensor_from_view(
    mv: memoryview, dtype: str, shape: tuple[int, ...], copy: bool, what: str
) -> torch.Tensor:
    """A tensor over ``mv`` (already validated by :func:`check_shape`); zero-copy unless ``copy``."""
    torch_dtype = TORCH_DTYPES[dtype]
    if len(mv) == 0:
        return torch.empty(shape, dtype=torch_dtype)
    if dtype == "bool":
        _check_bool_bytes(np.frombuffer(mv, dtype=np.uint8), what)
    t = torch.frombuffer(mv, dtype=torch_dtype).view(shape)
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


def tensor_from_device_bytes(
    region: torch.Tensor, dtype: str, shape: tuple[int, ...], copy: bool, what: str
) -> torch.Tensor:
    """A typed view of a 1-D uint8 tensor slice on any device (plain torch ops only)."""
    torch_dtype = TORCH_DTYPES[dtype]
    if region.numel() == 0:
        return torch.empty(shape, dtype=torch_dtype, device=region.device)
    if dtype == "bool":
        _check_bool_bytes(region, what)
    t = region.view(torch_dtype).view(shape)
    return t.clone() if copy else t


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
