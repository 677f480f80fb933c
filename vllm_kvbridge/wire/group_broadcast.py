"""Bytes from one rank of a ``torch.distributed`` group to the others, or why there are none.

One implementation for what three places hand across a group: a LEADER's received KV to
its FOLLOWERs (:mod:`vllm_kvbridge.kv.distribution`), a received payload to the other TP
ranks (:func:`vllm_kvbridge.runner.payload_stream.broadcast_payload`) and a 2-rank
diffusion stage's per-request control message (:mod:`vllm_kvbridge.runner.diffusion_ranks`).

Every rank of the group calls :func:`broadcast_buffers`, in the same order. The source
sends a header (``[count, size_0 .. size_{MAX_BUFFERS-1}]``, int64) and then each buffer;
``count == -1`` says the source has nothing to send, and its one buffer is the reason
(UTF-8), which every other rank raises as :class:`~vllm_kvbridge.errors.TransferError`.
A receiving rank checks the header (count and sizes, and ``max_bytes``) before it
allocates anything. Two collectives for one buffer, ``1 + n`` for ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_kvbridge.errors import TransferError

#: Buffers one call carries at most (the header has a slot per buffer).
MAX_BUFFERS = 15
_FAILED = -1


def broadcast_buffers(
    buffers: Sequence[torch.Tensor] | str | None,
    group: Any = None,
    src: int = 0,
    *,
    device: torch.device | str = "cpu",
    max_bytes: int | None = None,
    what: str = "broadcast",
) -> list[torch.Tensor]:
    """Hand ``buffers`` (1-D uint8 tensors on ``device``) from group rank ``src`` to the others.

    On ``src``: the buffers (returned as they are), or a ``str`` saying why there are none
    (the others raise it; ``src`` gets ``[]`` and raises what it likes). On every other
    rank: pass None; returns the buffers, or raises :class:`TransferError`
    ``"{what} from rank {src} failed: {reason}"``. ``max_bytes`` bounds each buffer a
    receiving rank accepts.
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    global_src = dist.get_global_rank(group, src) if group is not None else src
    header = torch.zeros(MAX_BUFFERS + 1, dtype=torch.int64)
    sends: list[torch.Tensor] = []
    if rank == src:
        if buffers is None or isinstance(buffers, str):
            reason = (buffers or "nothing to send").encode()
            sends = [torch.frombuffer(bytearray(reason), dtype=torch.uint8).to(device)]
            header[0] = _FAILED
        else:
            sends = list(buffers)
            if len(sends) > MAX_BUFFERS:
                raise ValueError(f"{what}: {len(sends)} buffers, at most {MAX_BUFFERS} per call")
            header[0] = len(sends)
        for i, buf in enumerate(sends):
            header[1 + i] = buf.numel()
    header = header.to(device)
    dist.broadcast(header, global_src, group=group)
    count, *sizes = header.tolist()
    sizes = sizes[: 1 if count == _FAILED else count]
    if rank != src:
        if not _FAILED <= count <= MAX_BUFFERS or any(s < 0 for s in sizes):
            raise TransferError(f"{what} from rank {src}: malformed header {header.tolist()}")
        if max_bytes is not None and count != _FAILED and any(s > max_bytes for s in sizes):
            raise TransferError(f"{what} from rank {src}: a buffer of {max(sizes)} bytes (limit {max_bytes})")
        sends = [torch.empty(int(s), dtype=torch.uint8, device=device) for s in sizes]
    for buf in sends:
        dist.broadcast(buf, global_src, group=group)
    if count != _FAILED:
        return sends
    if rank == src:
        return []
    reason = bytes(sends[0].cpu().numpy()).decode(errors="replace")
    raise TransferError(f"{what} from rank {src} failed: {reason}")


__all__ = ["MAX_BUFFERS", "broadcast_buffers"]
