"""Tensors written where they are packed: the sender's one-copy path.

A :class:`TensorFill` stands in for a tensor in a
:class:`~vllm_kvbridge.wire.kv_format.KVCacheTransferData`: it knows its shape and dtype
(so the packed layout and the header can be computed without the data) and a function
that writes the values into a destination tensor. :meth:`Encoded.pack_into
<vllm_kvbridge.wire.codec.Encoded.pack_into>` calls that function on a view of the
destination at the tensor's offset, so the values are copied once, from wherever they
live (vLLM's paged KV cache) to where the receiver reads them (a shared-memory segment, a
registered buffer). Paths that need the bytes elsewhere (``frames()``, ``to_bytes()``)
call :meth:`TensorFill.materialize` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from vllm_kvbridge.errors import PayloadError


class TensorFill:
    """A ``shape``/``dtype`` tensor whose values ``fill(out)`` writes into the contiguous
    CPU or device tensor ``out`` of that shape and dtype (on the caller's thread).

    ``device`` is where ``fill`` reads from: a destination in host memory is filled
    straight from a CPU source; from another device, through one staging tensor there,
    moved by ``to_host(out, staged)`` where given (e.g. a ``non_blocking`` copy on a side
    stream into pinned memory), else by a blocking ``copy_``.
    """

    __slots__ = ("_fill", "_to_host", "device", "dtype", "shape")

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        fill: Callable[[torch.Tensor], object],
        device: torch.device | str = "cpu",
        to_host: Callable[[torch.Tensor, torch.Tensor], object] | None = None,
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self._fill = fill
        self._to_host = to_host

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def numel(self) -> int:
        return math.prod(self.shape)

    def fill_bytes(self, region: memoryview, start: int) -> None:
        """Write the values into ``region[start : start + nbytes]`` (a writable host buffer)."""
        nbytes = self.nbytes
        if nbytes == 0:
            return
        if start < 0 or start + nbytes > len(region):
            raise PayloadError(f"internal error: a {nbytes}-byte fill at {start} overruns {len(region)}")
        dst = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=start)
        self.fill_into(dst.view(self.dtype).view(self.shape))

    def fill_into(self, out: torch.Tensor) -> None:
        """Write the values into ``out`` (contiguous, this shape and dtype): straight from
        the source on its own device, else through one staging tensor on :attr:`device`."""
        if out.device == self.device:
            self._fill(out)
        elif self._to_host is not None and out.device.type == "cpu":
            self._to_host(out, self.materialize())
        else:
            out.copy_(self.materialize())

    def materialize(self) -> torch.Tensor:
        """The values as a new tensor on :attr:`device`."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self._fill(out)
        return out

    def __repr__(self) -> str:
        return f"TensorFill(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


__all__ = ["TensorFill"]
