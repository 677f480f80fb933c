"""Copies between host and device that do not block the caller (the model thread).

Device to host: one copy per batch, an event to wait on (:class:`StagedRows`); host to
device: pinned and ``non_blocking`` (:func:`to_device`, e.g. a request's block index),
and the tensors of a received payload in one copy per buffer (:func:`tensors_to_device`).

A per-request ``tensor.to("cpu")`` of a CUDA tensor is a blocking copy from the device into
pageable memory: one synchronisation of the model thread per request per step. Here the
rows of a whole batch go to the host in **one** ``non_blocking`` copy into pinned memory
(pageable memory would make it synchronous again), and a CUDA event recorded after it
marks completion. :meth:`StagedRows.take` waits on that event (by then it has usually long
completed: vLLM's own sampled-token copy of the same step follows it on the stream) and
hands each span out as its own pageable tensor, so the pinned buffer goes back to torch's
pinned-memory cache at once and no request keeps another request's rows alive.

On a CPU source the same path runs with the pinned memory and the event as no-ops: the
spans are concatenated straight into the host buffer.

Imports neither vLLM nor any other layer of the package above ``errors``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch


class StagedRows:
    """Spans of rows of one device tensor on their way to the host (see the module docstring).

    ``spans``: ``{key: (start, end)}`` row ranges of ``source`` (dim 0); :meth:`take`
    returns ``{key: rows}`` in the same order. The copy is enqueued on the caller's
    (current) stream here.
    """

    __slots__ = ("_buffer", "_event", "_spans")

    def __init__(self, source: torch.Tensor, spans: Mapping[Hashable, tuple[int, int]]) -> None:
        self._spans = {key: (int(a), int(b)) for key, (a, b) in spans.items()}
        for a, b in self._spans.values():
            if not 0 <= a <= b <= source.shape[0]:
                raise ValueError(f"row span [{a}, {b}) outside [0, {source.shape[0]})")
        rows = sum(b - a for a, b in self._spans.values())
        # Only CUDA gets the asynchronous path (pinned + non_blocking + event); another
        # accelerator copies blocking, which is correct where no event tells completion.
        cuda = source.device.type == "cuda"
        self._buffer: torch.Tensor | None = host_buffer((rows, *source.shape[1:]), source.dtype, pinned=cuda)
        self._event: torch.cuda.Event | None = None
        parts = [source[a:b] for a, b in self._spans.values() if b > a]
        if not parts:
            return
        if source.device.type == "cpu":
            torch.cat(parts, out=self._buffer)
            return
        # One kernel gathers the spans on the device (asynchronous), one copy moves them.
        packed = parts[0] if len(parts) == 1 else torch.cat(parts)
        self._buffer.copy_(packed, non_blocking=cuda)
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def pinned(self) -> bool:
        """Whether the staging buffer is page-locked (a CUDA source)."""
        return self._buffer is not None and self._buffer.is_pinned()

    def ready(self) -> bool:
        """Whether the copy has completed (never waits)."""
        return self._event is None or self._event.query()

    def take(self) -> dict[Hashable, torch.Tensor]:
        """Wait for the copy; per key a new pageable host tensor of its rows. Once."""
        if self._buffer is None:
            raise RuntimeError("StagedRows.take() called twice")
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        buffer, self._buffer = self._buffer, None  # pinned memory goes back to torch's cache
        out, at = {}, 0
        for key, (a, b) in self._spans.items():
            out[key] = buffer[at : at + b - a].clone()
            at += b - a
        return out


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device`` without blocking the caller on CUDA (a pageable host-to-device
    copy synchronises the model thread): pinned, then a ``non_blocking`` copy. Work queued
    after it on the stream sees the values; torch keeps the pinned source until the copy
    is done. Elsewhere a plain ``to`` (on a CPU device: ``host`` itself)."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


#: Alignment of the start of a staged span (at least any element size).
_ALIGN = 64


def tensors_to_device(
    tensors: Sequence[torch.Tensor | None], device: torch.device | str, *, copy: bool = False
) -> list[torch.Tensor | None]:
    """``tensors`` (host) on ``device``, the same values, shapes and dtypes; None stays None.
    ``copy``: new tensors also for those already on ``device`` (as ``Tensor.to(copy=True)``).

    A received payload is decoded in place: its tensors are views of one host buffer (a
    shared-memory mapping, a registered slab). A ``.to(device)`` per tensor would be one
    blocking, pageable copy each; here the span of the buffer they view goes in **one**
    copy per buffer: a host copy into pinned staging, then one ``non_blocking`` transfer
    (on CUDA; a plain copy elsewhere), and each tensor becomes a view of the device copy at
    its own offset. Work queued on the stream afterwards sees the values. A tensor that is
    not contiguous, or not in host memory, is moved on its own; one already on ``device``
    stays as it is unless ``copy``.
    """
    device = torch.device(device)
    out: list[torch.Tensor | None] = list(tensors)
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is None or (t.device == device and not copy):
            continue
        if t.device.type != "cpu" or not t.is_contiguous():
            out[i] = t.to(device, copy=copy)
            continue
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(i)
    for members in groups.values():
        spans = [_byte_span(tensors[i]) for i in members]  # type: ignore[arg-type]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        lo -= lo % _ALIGN  # so every view starts at a multiple of its element size
        storage = tensors[members[0]].untyped_storage()  # type: ignore[union-attr]
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        cuda = device.type == "cuda"
        staging = host_buffer((hi - lo,), torch.uint8, pinned=cuda)
        staging.copy_(whole[lo:hi])
        on_device = staging.to(device, non_blocking=cuda)
        for i, (a, b) in zip(members, spans, strict=True):
            t = tensors[i]
            assert t is not None
            out[i] = on_device[a - lo : b - lo].view(t.dtype).view(t.shape)
    return out


def pairs_to_device(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(K, V)`` pairs on ``device`` through :func:`tensors_to_device` (one copy
    per received buffer, not two blocking copies per layer)."""
    flat = tensors_to_device([t for pair in pairs for t in pair], device)
    return [(k, v) for k, v in zip(flat[0::2], flat[1::2], strict=True)]  # type: ignore[misc]


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[start, end)`` bytes of a contiguous tensor in its storage."""
    start = t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def host_buffer(shape: Sequence[int], dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor; page-locked when ``pinned`` (only where an accelerator
    exists: pinning needs its driver, and a CPU source gains nothing from it)."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pinned)


__all__ = ["StagedRows", "host_buffer", "pairs_to_device", "tensors_to_device", "to_device"]
