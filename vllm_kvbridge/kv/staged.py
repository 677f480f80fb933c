"""The staged send path's parts (used by :mod:`vllm_kvbridge.kv.send`): the :class:`Stager`
(pool + copy stream of one sender), :class:`StagedReservation` (a payload waiting in the
pool for the connector's destination), :class:`HostGather` (a CUDA cache's KV written into
host memory through the copy stream's bounded device scratch) and the "no room now"
exceptions that keep a request's KV in the engine's blocks.

Memory outside vLLM's budget on a GPU stage is bounded by figures, whatever the requests:
pinned host memory by ``staging_bytes`` (an :class:`~vllm_kvbridge.wire.pinned_pool.ArenaPool`,
pinned once, off the model thread), device memory by the copy stream's scratch
(:func:`scratch_bytes_for`, at most :data:`~vllm_kvbridge.wire.staging.DEVICE_SCRATCH_BYTES`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from vllm_kvbridge.connectors.base import Connector, PutResult, Reservation
from vllm_kvbridge.kv.config import KVTransferConfig, StageId
from vllm_kvbridge.kv.paged import BlockTable, RequestGather
from vllm_kvbridge.wire.fill import TensorFill
from vllm_kvbridge.wire.pinned_pool import ArenaPool
from vllm_kvbridge.wire.staging import (
    DEVICE_SCRATCH_BYTES,
    MIN_BUFFER,
    CopyStream,
    Fence,
    StagingBuffer,
    StagingPool,
    default_staging_bytes,
)

__all__ = ["HostGather", "ReserveFull", "StagedReservation", "Stager", "StagingFull", "scratch_bytes_for"]


class StagingFull(Exception):
    """No room for a held request's KV now (the staging pool's, or the connector's own
    memory: :class:`ReserveFull`): its blocks stay held, the gather is tried again later."""


class ReserveFull(StagingFull):
    """The connector lends device memory (CUDA IPC) and its budget is full: the request's KV
    stays in its blocks rather than going through host memory on the model thread."""


def scratch_bytes_for(capacity: int) -> int:
    """Device scratch of a stager whose pool holds ``capacity`` bytes: an eighth of it, at
    least one :data:`MIN_BUFFER`, at most :data:`DEVICE_SCRATCH_BYTES`."""
    return min(DEVICE_SCRATCH_BYTES, max(MIN_BUFFER, capacity // 8))


class Stager:
    """The staged send path of one sender: its pool and copy stream (module docstrings).

    On CUDA the pool is an :class:`ArenaPool` pinned by a thread of its own: ``background``
    returns at once and pins from the first use, or :meth:`prepare` (a sender's first
    gathers find it not ready and wait in their blocks); else the constructor pins it and
    waits. ``bypassed`` counts requests sent on the direct path instead (too big for the
    pool, or it was full where the caller cannot hold their blocks); ``deferred`` those
    held for want of room in the pool; ``reserve_full`` the gathers that found the
    connector's own memory full (and ``reserve_full_reason`` its last answer, which the
    message of a request held past ``send_timeout`` shows).
    """

    def __init__(
        self,
        capacity: int,
        device: torch.device,
        *,
        scratch_bytes: int | None = None,
        background: bool = False,
    ) -> None:
        scratch = scratch_bytes_for(capacity) if scratch_bytes is None else scratch_bytes
        self.stream = CopyStream(device, scratch_bytes=scratch)
        self.pool: ArenaPool | StagingPool
        if self.stream.cuda and capacity >= MIN_BUFFER:
            self.pool = ArenaPool(capacity, self.stream.device, wait=not background)
        else:  # CPU caches (or a pool too small for one block): pageable, as it always was
            self.pool = StagingPool(capacity, pinned=False)
        self.bypassed = self.deferred = self.reserve_full = 0
        self.reserve_full_reason = ""

    @classmethod
    def create(cls, config: KVTransferConfig, device: torch.device) -> Stager | None:
        """The stager for caches on ``device``: ``config.staging_bytes``, or where unset the
        default of :func:`~vllm_kvbridge.wire.staging.default_staging_bytes` shared by the
        ``from_tp`` ranks of the stage; None for 0 (the direct path). Its pinned memory is
        prepared in the background from its first use (this runs on the model thread, and a
        connector that lends device memory may never need the pool)."""
        budget = config.staging_bytes
        budget = default_staging_bytes(device) // max(1, config.from_tp) if budget is None else budget
        return cls(budget, device, background=True) if budget > 0 else None

    def prepare(self) -> None:
        """Start pinning the pool now, in the background (e.g. when the caches are
        registered, so no request waits for it); returns at once."""
        if isinstance(self.pool, ArenaPool):
            self.pool.prepare()

    def fits(self, sizes: Sequence[int]) -> bool:
        return self.pool.fits_together(sizes)

    def acquire(self, sizes: Sequence[int]) -> list[StagingBuffer] | None:
        """One buffer per size, all or none (None: no room now)."""
        got: list[StagingBuffer] = []
        for n in sizes:
            buf = self.pool.acquire(n)
            if buf is None:
                for b in got:
                    b.release()
                return None
            got.append(buf)
        return got

    def connector_full(self, why: str) -> None:
        """The connector answered ``full`` at a gather (see :class:`ReserveFull`)."""
        self.reserve_full += 1
        self.reserve_full_reason = why

    def stats(self) -> dict[str, Any]:
        # First, where there is one: the connector's words for what a held request waits for.
        out: dict[str, Any] = {"reserve_full_reason": self.reserve_full_reason} if self.reserve_full else {}
        out.update(self.pool.stats())
        out.update(
            bypassed=self.bypassed,
            deferred=self.deferred,
            reserve_full=self.reserve_full,
            scratch_bytes=self.stream.scratch_bytes,
        )
        return out

    def close(self) -> None:
        self.stream.close()
        if isinstance(self.pool, ArenaPool):
            self.pool.close()


class HostGather:
    """One route's KV from a CUDA cache into host memory (``TensorFill`` s that write host
    tensors), through ``stream``'s bounded device scratch: each layer's K or V in chunks of
    whole blocks, never a whole layer (or request) on the device at once."""

    def __init__(self, stream: CopyStream, request: RequestGather) -> None:
        self._stream, self._request = stream, request
        #: (table, rows) -> the gather of those rows of that block table
        self._parts: dict[tuple[int, int, int], RequestGather] = {}
        self._index_kept = False

    def fills(self, kind: int) -> list[torch.Tensor | TensorFill | None]:
        """One fill per layer. Their ``device`` is the host: they write host tensors only
        (through the scratch), so a packer hands them its host destination directly."""
        request = self._request
        return [
            TensorFill(request.shape(layer, kind), request.dtype, partial(self._write, layer, kind), "cpu")
            for layer in range(len(request.kv_caches))
        ]

    def _write(self, layer: int, kind: int, out: torch.Tensor) -> None:
        rows = partial(self.write_rows, layer, kind)
        self._stream.stage(out, rows, align=self._request.layout.tokens_per_block)

    def write_rows(self, layer: int, kind: int, start: int, end: int, dst: torch.Tensor) -> None:
        """Write rows ``[start, end)`` of ``layer``'s ``kind`` (its tokens from the first one its
        block table holds) into ``dst`` (on the cache's device)."""
        request = self._request
        if (start, end) == (0, request.shape(layer, kind)[0]):
            if request.device.type == "cuda" and not self._index_kept:
                # Its block indexes were made on the model's stream and are read here, maybe on
                # the copy stream: the allocator must not reuse them before that read.
                for index in request.device_indexes():
                    index.record_stream(torch.cuda.current_stream(request.device))
                self._index_kept = True
            request.write(layer, kind, dst)
            return
        g = request.layer_tables[layer]
        part = self._parts.get((g, start, end))
        if part is None:  # made on the gather's stream (its index copy is ordered before use)
            table = request.tables[g]
            part = RequestGather(
                request.kv_caches,
                request.layout,
                [BlockTable(table.block_ids, table.start + start)],
                table.start + end,
                layer_tables=[0] * len(request.kv_caches),
                head_start=request.head_start,
                head_end=request.head_end,
            )
            self._parts[(g, start, end)] = part
        part.write(layer, kind, dst)


class StagedReservation(Reservation):
    """A payload staged in a pool buffer. :meth:`publish` waits for the staging copy, copies
    the bytes into a destination reserved from the connector (a full connector answers
    ``full``: the put waits for room, the staged bytes stay in the pool), gives the staging
    buffer back at once (a slow edge holds its own memory, not the pinned pool) and
    publishes the destination. A device destination (CUDA IPC) is filled host to device on
    this (the I/O) thread; ``head_size`` is then the size of the packed head it needs."""

    def __init__(
        self,
        staging: StagingBuffer,
        fence: Fence,
        connector: Callable[[], Connector],
        from_stage: StageId,
        to_stage: StageId,
        key: str,
        head_size: int = 0,
    ) -> None:
        super().__init__(key, staging.nbytes, staging.view)
        self._staging: StagingBuffer | None = staging
        self._fence, self._connector, self._stages = fence, connector, (from_stage, to_stage)
        self._dest: Reservation | None = None
        self._head_size = head_size

    def publish(self) -> PutResult:
        if self._dest is None:
            if self._staging is None:
                return PutResult(ok=False, error=f"reservation of {self.key!r} was published or released")
            self._fence.wait()
            got = self._connector().reserve(*self._stages, self.key, self.nbytes)
            if not isinstance(got, Reservation):
                return got  # full: retried when there may be room; an error: retried
            if isinstance(got.buffer, torch.Tensor):  # device memory: blocking, off the model thread
                got.buffer[: self.nbytes].copy_(self._staging.tensor)
                got.filled(bytes(self._staging.view[: self._head_size]))  # type: ignore[attr-defined]
            elif self.nbytes:  # staging -> destination (torch's copy releases the GIL)
                torch.frombuffer(got.buffer, dtype=torch.uint8, count=self.nbytes).copy_(self._staging.tensor)
            self._dest = got
            self._release_staging()
        result = self._dest.publish()
        if result.ok:
            self._dest = None  # the connector owns it now
        return result

    def release(self) -> None:
        dest, self._dest = self._dest, None
        if dest is not None:
            dest.release()
        self._release_staging()

    def _release_staging(self) -> None:
        staging, self._staging = self._staging, None
        if staging is not None:
            try:
                self._fence.wait()  # a copy still writing into it must finish first
            except Exception:  # the copy's error reached whoever waited for the publish
                pass
            staging.release()
