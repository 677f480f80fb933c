"""The packed layout in device memory (plain torch, no vLLM).

:func:`pack_into_device` writes an :class:`~vllm_kvbridge.wire.codec.Encoded` payload into
a contiguous 1-D uint8 tensor on any device, byte for byte the layout
:meth:`Encoded.pack_into <vllm_kvbridge.wire.codec.Encoded.pack_into>` writes into host
memory (same prefix, table and offsets), and returns the head (prefix, table, skeleton):
the few bytes a receiver needs on the host to decode, which travel beside the device
buffer (the CUDA-IPC connector puts them in its control message) so that decoding
(:func:`~vllm_kvbridge.wire.decode.decode_packed_device`) reads no device byte back.

Sources land without a host hop where they can: a
:class:`~vllm_kvbridge.wire.fill.TensorFill` whose source is on the destination's device
(the KV sender's gather from the paged cache) writes straight into its range; host
sources (memoryviews, CPU tensors) are copied host to device. Padding between buffers is
left as it was (the decoder reads only the table's ranges), unlike the host path, which
zeroes it. The copies are enqueued on the caller's current stream and none of them
synchronises it (host bytes go through pinned memory, ``non_blocking``): whoever hands the
buffer to another stream or process must order after them first (an event).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from vllm_kvbridge.errors import PayloadError
from vllm_kvbridge.wire.codec import Encoded
from vllm_kvbridge.wire.fill import TensorFill

__all__ = ["pack_into_device"]


def pack_into_device(enc: Encoded, dst: torch.Tensor) -> bytes:
    """Write ``enc``'s packed layout into ``dst[:enc.packed_size()]`` (a contiguous 1-D
    uint8 tensor on any device); return its head bytes (see the module docstring).

    Raises :class:`PayloadError` if ``dst`` is not such a tensor, is too small, or a source
    tensor was changed in place since :func:`~vllm_kvbridge.wire.codec.encode`.
    """
    offsets, sizes, total = enc._table()
    if (
        not isinstance(dst, torch.Tensor)
        or dst.dtype != torch.uint8
        or dst.dim() != 1
        or not dst.is_contiguous()
    ):
        raise PayloadError("device destination must be a contiguous 1-D uint8 tensor")
    if dst.numel() < total:
        raise PayloadError(f"destination too small: need {total} bytes, has {dst.numel()}")
    head = enc._head()
    _from_host(dst[: len(head)], head)
    for index, (start, size, src) in enumerate(zip(offsets, sizes, enc._sources)):
        if size == 0:
            continue
        region = dst[start : start + size]
        if type(src) is TensorFill:
            src.fill_into(region.view(src.dtype).view(src.shape))
        elif type(src) is memoryview:
            _from_host(region, src)
        else:  # a dense CPU tensor (see Encoded): its bytes as they are now
            if src.nbytes != size or not src.is_cpu or not src.is_contiguous():
                raise PayloadError(f"buffer {index}: its tensor was changed in place after encode")
            _from_host(region, src.reshape(-1).view(torch.uint8))
    return head


def _from_host(region: torch.Tensor, data: Any) -> None:
    """Copy host bytes into ``region``. Into CUDA memory through pinned memory and
    ``non_blocking``: a copy from pageable memory would synchronise the caller's stream
    (the model thread, for a KV send) with everything queued on it. Torch's pinned
    allocator keeps the pinned block until the copy's stream has passed it."""
    src = data if isinstance(data, torch.Tensor) else _host_bytes(data)
    if region.is_cuda:
        region.copy_(src.pin_memory(), non_blocking=True)
    else:
        region.copy_(src)


def _host_bytes(data: Any) -> torch.Tensor:
    """A uint8 tensor over ``data``'s bytes (no copy). Read-only sources are only read, so
    torch's warning about them (it cannot tell) is silenced."""
    arr = np.frombuffer(data, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)
