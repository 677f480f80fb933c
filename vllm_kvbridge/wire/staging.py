"""Host staging for gathered KV: a bounded pool of host buffers and a copy stream with fences.

Why: on a GPU, copying a finished request's blocks straight into the connector's
destination (a shared-memory segment, a registered slab) is a blocking device-to-host copy
into pageable memory on the model thread, and a gathered copy that stays on the device
waits there, unbounded and outside vLLM's memory budget. The staged path instead:

1. gathers the request's blocks on the device, a chunk of whole blocks at a time, into a
   small **bounded** device scratch of the :class:`CopyStream` (two slots reused in turn,
   :data:`DEVICE_SCRATCH_BYTES` at most: the only device memory the path uses outside
   vLLM's budget, whatever the request size);
2. copies each chunk ``non_blocking`` into a **pinned** buffer of a bounded pool on a side
   stream, the slot being reused only after that copy (an event, waited for on the
   device, never on the model thread), and records an event after the last copy;
3. hands the I/O thread a :class:`Fence`; it waits on the fence, not the model thread, then
   copies the staged bytes into the connector's destination and publishes them.

A request whose blocks stay held (``inline=False``) is gathered on the side stream too, after
the model stream's work so far: the model stream never waits for it. One whose blocks vLLM
may reuse at once (``inline=True``) is gathered on the model stream, so later writes to its
blocks come after the read. The blocks may go back to vLLM (``finished_sending``) only once
the fence is done. When the pool has no room, the request is not gathered: its blocks stay
held in the engine (that is the backpressure) and the pool's ``full`` counts it; nothing is
dropped.

The pinned pool on CUDA is :class:`~vllm_kvbridge.wire.pinned_pool.ArenaPool` (its pinned
bytes are exactly its budget, pinned off the model thread). :class:`StagingPool` here is
the pageable pool of CPU caches.

On CPU caches the same path runs with CPU tensors (as it does in ``make test``): buffers
are not pinned, and the copy stream is one thread that runs the gathers in order, so the
fence is a real completion there too. It costs a second copy (staging, then destination),
so CPU stages use the direct one-copy path unless ``staging_bytes`` asks for this one.

Imports neither vLLM nor any other layer of the package (only its sibling
:mod:`~vllm_kvbridge.wire.host_staging`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_kvbridge.wire.host_staging import host_buffer

logger = logging.getLogger(__name__)

__all__ = [
    "DEVICE_SCRATCH_BYTES",
    "MIN_BUFFER",
    "CopyStream",
    "Fence",
    "StagingBuffer",
    "StagingPool",
    "chunk_rows",
    "default_staging_bytes",
]

#: Smallest buffer the pool hands out; sizes are rounded up to a power of two from here,
#: so a buffer is reused by requests of similar size (pinned allocation is slow).
MIN_BUFFER = 1 << 20
#: Default pool size on a GPU stage: this share of host memory, at most :data:`MAX_DEFAULT`.
DEFAULT_SHARE, MAX_DEFAULT = 1 / 8, 8 << 30
#: Device bytes a CUDA copy stream gathers through (its two slots together), at most; a
#: slot grows only to hold one block of one layer where that is bigger (a property of
#: the model, not of the request).
DEVICE_SCRATCH_BYTES = 32 << 20


def default_staging_bytes(device: torch.device) -> int:
    """The staging budget used where the config leaves it unset: 0 (direct path) for CPU
    caches; for CUDA, :data:`DEFAULT_SHARE` of host memory, capped at :data:`MAX_DEFAULT`."""
    if device.type != "cuda":
        return 0
    import os

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(total * DEFAULT_SHARE, MAX_DEFAULT))


class Fence:
    """Completion of the copies submitted to a :class:`CopyStream` before it was taken.

    Backed by a CUDA event (GPU) or a ``threading.Event`` (the CPU copy thread); a fence
    made by :meth:`done_now` is complete from the start. :meth:`wait` re-raises the error of
    a copy that failed (CPU thread); thread-safe.
    """

    __slots__ = ("_cuda", "_error", "_set")

    def __init__(self, cuda_event: Any = None, flag: threading.Event | None = None) -> None:
        self._cuda, self._set, self._error = cuda_event, flag, None

    @classmethod
    def done_now(cls) -> Fence:
        return cls()

    def done(self) -> bool:
        """Whether the copies completed (never waits)."""
        if self._cuda is not None:
            return bool(self._cuda.query())
        return self._set is None or self._set.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Until the copies completed; raises their error, or TimeoutError after ``timeout``."""
        if self._cuda is not None:
            self._cuda.synchronize()  # CUDA events have no timeout; a copy always completes
        elif self._set is not None and not self._set.wait(timeout):
            raise TimeoutError(f"copy not completed within {timeout} s")
        if self._error is not None:
            raise self._error

    def _fail(self, exc: BaseException) -> None:
        self._error = exc


def chunk_rows(rows: int, row_bytes: int, align: int, slot_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges covering ``rows``, in order: each as many whole groups of
    ``align`` rows as fit ``slot_bytes`` (at least one group), so each starts at a multiple
    of ``align``."""
    align = max(1, align)
    per = max(1, slot_bytes // max(1, row_bytes) // align) * align
    return [(start, min(rows, start + per)) for start in range(0, rows, per)]


class CopyStream:
    """Where the copies that read a request's blocks run, off the model thread.

    CUDA: :meth:`submit` runs ``fn`` on the caller's thread; ``fn`` queues its device work
    through :meth:`stage` (gathers into the scratch, copies to pinned host memory on this
    object's side stream); the returned fence is an event recorded there after them. CPU:
    ``fn`` runs on one copy thread, in submission order; ``inline=True`` runs it on the
    caller's thread instead (for blocks the caller may free right after).

    ``scratch_bytes``: the device scratch (two slots), made at the first :meth:`stage`.
    """

    def __init__(self, device: torch.device | str, scratch_bytes: int = DEVICE_SCRATCH_BYTES) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._jobs: queue.Queue[tuple[Callable[[], object], Fence] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        # CUDA scratch: two slots, each with the events of its last gather and last copy out.
        self._slot_bytes = max(1, int(scratch_bytes) // 2)
        self._slots: list[torch.Tensor] = []
        self._gathered: list[Any] = []
        self._copied: list[Any] = []
        self._turn = 0
        self._gather_stream: Any = None  # set while a submit runs fn (CUDA)

    @property
    def scratch_bytes(self) -> int:
        """Device bytes the scratch holds now (0 until the first CUDA :meth:`stage`)."""
        return self._slot_bytes * len(self._slots)

    def submit(self, fn: Callable[[], object], *, inline: bool = False) -> Fence:
        """Run ``fn`` (its copies) as described above; the fence completes after them."""
        if self.cuda:
            assert self._stream is not None
            model = torch.cuda.current_stream(self.device)
            if not inline:  # gathered on the side stream, after what produced the KV
                self._stream.wait_stream(model)
            self._gather_stream = model if inline else self._stream
            try:
                fn()
            finally:
                self._gather_stream = None
            event = torch.cuda.Event()
            event.record(self._stream)
            return Fence(cuda_event=event)
        if inline:
            fn()
            return Fence.done_now()
        fence = Fence(flag=threading.Event())
        with self._lock:
            if self._closed:
                raise RuntimeError("copy stream is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvbridge-kv-copy", daemon=True)
                self._thread.start()
            self._jobs.put((fn, fence))
        return fence

    def stage(
        self, out: torch.Tensor, write: Callable[[int, int, torch.Tensor], object], align: int = 1
    ) -> None:
        """Fill the host tensor ``out`` (``[rows, ...]``, contiguous) with device data that
        ``write(start, end, dst)`` writes, rows ``[start, end)``, into the device tensor ``dst``.

        CUDA: through the scratch, in chunks of a multiple of ``align`` rows. Inside a
        :meth:`submit` the copies to ``out`` (a pinned buffer) are ``non_blocking`` on the
        side stream and complete with the submit's fence; elsewhere (a pageable destination)
        they are blocking, done when this returns. Elsewhere than CUDA: ``write(0, rows, out)``.
        """
        rows = int(out.shape[0]) if out.dim() else 0
        if not self.cuda:
            write(0, rows, out)
            return
        if rows == 0:
            return
        assert self._stream is not None
        row_bytes = out[0].numel() * out.element_size()
        self._ensure_slots(row_bytes * max(1, align))
        staged = self._gather_stream is not None  # into a pinned buffer, completed by a fence
        gather = self._gather_stream if staged else torch.cuda.current_stream(self.device)
        copy = self._stream if staged else gather
        for start, end in chunk_rows(rows, row_bytes, align, self._slot_bytes):
            i, self._turn = self._turn, self._turn ^ 1
            dst = (
                self._slots[i][: (end - start) * row_bytes].view(out.dtype).view(end - start, *out.shape[1:])
            )
            gather.wait_event(self._copied[i])  # the slot's last copy out read it (no-op if none)
            with torch.cuda.stream(gather):
                write(start, end, dst)
            if copy is not gather:
                self._gathered[i].record(gather)
                copy.wait_event(self._gathered[i])
            with torch.cuda.stream(copy):
                out[start:end].copy_(dst, non_blocking=staged)
            self._copied[i].record(copy)

    def _ensure_slots(self, need: int) -> None:
        """Make the slots, or grow them to ``need`` bytes (one aligned group of rows)."""
        if self._slots and need <= self._slot_bytes:
            return
        if self._slots:  # rare (a bigger block than before): the old slots may be in use
            torch.cuda.synchronize(self.device)
        self._slot_bytes = max(self._slot_bytes, need)
        with torch.cuda.stream(self._stream):
            self._slots = [
                torch.empty(self._slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
        self._gathered = [torch.cuda.Event() for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)]

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            fn, fence = item
            try:
                fn()
            except BaseException as exc:  # the fence carries it to whoever waits
                logger.exception("kvbridge: a staged KV copy failed")
                fence._fail(exc)
            assert fence._set is not None
            fence._set.set()

    def close(self, timeout: float = 5.0) -> None:
        """Finish the copies submitted so far, then stop the copy thread (CUDA: free the
        scratch); idempotent."""
        with self._lock:
            self._closed, thread = True, self._thread
            self._thread = None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)
        if self.cuda and self._slots:
            torch.cuda.synchronize(self.device)  # no copy reads the scratch any more
            self._slots = []


class StagingBuffer:
    """``nbytes`` of a pooled host buffer (:attr:`tensor`, uint8; :attr:`view`, a memoryview).
    :meth:`release` gives it back to its pool (idempotent); the caller must not touch the
    memory afterwards, and must not release it while a copy into it is in flight."""

    __slots__ = ("_block", "_pool", "nbytes", "tensor", "view")

    def __init__(self, pool: Any, block: torch.Tensor, nbytes: int) -> None:  # any pool's _give_back
        self._pool, self._block, self.nbytes = pool, block, nbytes
        self.tensor = block[:nbytes]
        self.view = memoryview(self.tensor.numpy()) if nbytes else memoryview(b"")

    def release(self) -> None:
        block, self._block = self._block, None
        if block is not None:
            self.tensor = self.view = None  # type: ignore[assignment]
            self._pool._give_back(block)


class StagingPool:
    """A bounded pool of host buffers, pinned when ``pinned`` (through torch's pinned
    allocator, which keeps what it pinned: the staged path pins through
    :class:`~vllm_kvbridge.wire.pinned_pool.ArenaPool` instead).

    Sizes round up to a power of two (at least :data:`MIN_BUFFER`); freed buffers are kept
    for reuse (pinning is slow) as long as the bytes allocated, in use or kept, stay within
    ``capacity``; kept buffers of other sizes are freed to make room. :meth:`acquire`
    returns None where a buffer does not fit now (:attr:`full` counts those refusals) and
    raises for a size that can never fit (:meth:`fits`). Thread-safe.
    """

    def __init__(self, capacity: int, *, pinned: bool) -> None:
        if capacity < 1:
            raise ValueError(f"staging pool capacity must be >= 1, got {capacity}")
        self.capacity, self.pinned = int(capacity), bool(pinned)
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._allocated = 0  # bytes of every buffer alive (in use + kept)
        self.in_use = 0
        self.peak = 0
        self.full = 0  # acquires refused for want of room

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(MIN_BUFFER, 1 << max(0, int(nbytes) - 1).bit_length())

    def fits(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` can ever be had from this pool."""
        return self.size_class(nbytes) <= self.capacity

    def fits_together(self, sizes: Sequence[int]) -> bool:
        """Whether buffers of all of ``sizes`` can ever be had at once."""
        return sum(self.size_class(n) for n in sizes) <= self.capacity

    def acquire(self, nbytes: int) -> StagingBuffer | None:
        """A buffer of ``nbytes``, or None while the pool has no room for it."""
        size = self.size_class(nbytes)
        if size > self.capacity:
            raise ValueError(f"{nbytes} bytes never fit a staging pool of {self.capacity} bytes")
        with self._lock:
            kept = self._free.get(size)
            if kept:
                block = kept.pop()
            else:
                if self.in_use + size > self.capacity:
                    self.full += 1
                    return None
                self._evict_locked(self._allocated + size - self.capacity)
                block = None
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
            if block is None:
                self._allocated += size
        if block is None:
            try:
                block = host_buffer((size,), torch.uint8, pinned=self.pinned)
            except BaseException:
                with self._lock:
                    self.in_use -= size
                    self._allocated -= size
                raise
        return StagingBuffer(self, block, nbytes)

    def _evict_locked(self, need: int) -> None:
        """Free kept buffers until ``need`` bytes are released (largest first)."""
        for size in sorted(self._free, reverse=True):
            kept = self._free[size]
            while need > 0 and kept:
                kept.pop()
                self._allocated -= size
                need -= size

    def _give_back(self, block: torch.Tensor) -> None:
        size = block.numel()
        with self._lock:
            self.in_use -= size
            self._free.setdefault(size, []).append(block)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "capacity": self.capacity,
                "pinned": self.pinned,
                "in_use": self.in_use,
                "allocated": self._allocated,
                "peak": self.peak,
                "full": self.full,
            }
