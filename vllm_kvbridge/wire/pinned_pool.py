"""Pinned host memory for the KV staging pool that its budget really bounds.

Why not ``torch.empty(..., pin_memory=True)``: torch's CachingHostAllocator keeps every
pinned block it ever made (a freed block goes back to its cache, never to the system) and
rounds each size up to a power of two, so a pool that frees buffers of one size to make
room for another pins more and more memory than its budget says. Here the pool's pinned
memory is one arena this process maps itself (anonymous ``mmap``), page-locked with
``cudaHostRegister`` and unlocked with ``cudaHostUnregister`` at :meth:`ArenaPool.close`:
the pinned bytes are exactly the budget (rounded down to whole :data:`MIN_BUFFER` s), and
they really go back.

Nothing is pinned on the caller's thread (pinning GiBs takes seconds): :meth:`ArenaPool.prepare`
(called by the first :meth:`~ArenaPool.acquire` where nobody called it before: a pool
never used pins nothing) starts a thread that registers the arena, a power-of-two part at
a time, smallest first, so small requests are served almost at once. Until a part that
fits is registered, :meth:`ArenaPool.acquire` answers None (counted in ``not_ready``): a
sender then holds the request in the engine's blocks or takes its direct path, as for a
full pool.

Buffers are blocks of a buddy allocator (:class:`BuddyAllocator`, plain bookkeeping):
sizes round up to a power of two from :data:`MIN_BUFFER`, freed neighbours merge again, so
requests of any mix of sizes share the arena without fragmenting it for good.

Imports neither vLLM nor any other layer of the package (only its sibling
:mod:`~vllm_kvbridge.wire.staging`).
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Sequence
from typing import Any

import torch

from vllm_kvbridge.wire.staging import MIN_BUFFER, StagingBuffer, StagingPool

logger = logging.getLogger(__name__)

__all__ = ["ArenaPool", "BuddyAllocator"]

#: ``cudaHostRegisterPortable``: pinned for every CUDA context of the process.
_REGISTER_PORTABLE = 1
#: The block size ``nbytes`` takes: a power of two, at least :data:`MIN_BUFFER` (as the
#: pageable pool's, so both answer ``fits`` alike).
size_class = StagingPool.size_class


class BuddyAllocator:
    """Offsets of power-of-two blocks in an arena of ``total`` bytes (bookkeeping only).

    The arena is split into *parts*, its binary decomposition in whole ``min_block`` s,
    largest first (so each part starts at a multiple of its own size, and a block's buddy
    is ``offset ^ size``). Parts join with :meth:`add_part` (when their memory is ready);
    a block never spans two parts. Not thread-safe: its owner locks.
    """

    def __init__(self, total: int, min_block: int = MIN_BUFFER) -> None:
        self.min_block = min_block
        units = max(0, int(total)) // min_block
        self.total = units * min_block
        #: (offset, size) of every part, largest first
        self.parts: list[tuple[int, int]] = []
        offset = 0
        for order in reversed(range(units.bit_length())):
            if units >> order & 1:
                self.parts.append((offset, min_block << order))
                offset += min_block << order
        self._part_size: dict[int, int] = {}  # offset -> size, of the parts added
        self._free: dict[int, set[int]] = {}  # block size -> offsets of free blocks
        self._used: dict[int, int] = {}  # offset -> size, of the blocks handed out

    @property
    def largest(self) -> int:
        """The biggest block this arena can ever hand out (0: none)."""
        return self.parts[0][1] if self.parts else 0

    def add_part(self, offset: int, size: int) -> None:
        """Part ``(offset, size)`` (one of :attr:`parts`) may be handed out from now on."""
        if (offset, size) not in self.parts or offset in self._part_size:
            raise ValueError(f"({offset}, {size}) is not a part of this arena not added yet")
        self._part_size[offset] = size
        self._free.setdefault(size, set()).add(offset)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free block of ``nbytes`` rounded up to a power of two (at least
        ``min_block``), or None for now."""
        want = max(self.min_block, 1 << max(0, int(nbytes) - 1).bit_length())
        size = want
        while size <= self.largest and not self._free.get(size):
            size *= 2
        if size > self.largest:
            return None
        offset = min(self._free[size])  # lowest first: deterministic, keeps the top free
        self._free[size].discard(offset)
        while size > want:  # split, keeping the upper halves free
            size //= 2
            self._free.setdefault(size, set()).add(offset + size)
        self._used[offset] = want
        return offset

    def free(self, offset: int) -> int:
        """Give the block at ``offset`` back (merging it with free buddies); its size."""
        size = self._used.pop(offset)
        freed = size
        part = self._part_of(offset)
        while size < part:
            buddy = offset ^ size  # within the part: it starts at a multiple of its size
            if buddy not in self._free.get(size, ()):
                break
            self._free[size].discard(buddy)
            offset, size = min(offset, buddy), size * 2
        self._free.setdefault(size, set()).add(offset)
        return freed

    def fits_together(self, sizes: Sequence[int], parts: Sequence[tuple[int, int]] | None = None) -> bool:
        """Whether blocks for all of ``sizes`` can be had at once from the empty arena (only
        from ``parts`` of it, where given)."""
        probe = BuddyAllocator(self.total, self.min_block)
        for offset, size in probe.parts if parts is None else parts:
            probe.add_part(offset, size)
        return all(probe.alloc(n) is not None for n in sorted(sizes, reverse=True))

    def _part_of(self, offset: int) -> int:
        for start, size in self.parts:
            if start <= offset < start + size:
                return size
        raise ValueError(f"offset {offset} outside the arena")


def _register(ptr: int, nbytes: int, device: torch.device) -> None:
    cudart = torch.cuda.cudart()
    with torch.cuda.device(device):
        err = cudart.cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {cudart.cudaGetErrorString(err)}")


def _unregister(ptr: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostUnregister(ptr)
    if int(err) != 0:
        logger.warning("kvbridge: cudaHostUnregister failed: %s", cudart.cudaGetErrorString(err))


class ArenaPool:
    """A bounded pool of host buffers in one arena of ``capacity`` bytes (rounded down to
    whole :data:`MIN_BUFFER` s), page-locked for ``device`` (a CUDA device; None: not
    pinned, the same bookkeeping on plain memory). The interface of
    :class:`~vllm_kvbridge.wire.staging.StagingPool`: :meth:`acquire` returns a
    :class:`~vllm_kvbridge.wire.staging.StagingBuffer` or None, whose ``release`` gives the
    block back. Thread-safe.
    """

    def __init__(self, capacity: int, device: torch.device | None = None, *, wait: bool = False) -> None:
        if capacity < MIN_BUFFER:
            raise ValueError(f"a staging arena needs at least {MIN_BUFFER} bytes, got {capacity}")
        self.capacity, self.pinned = int(capacity), device is not None
        self._buddy = BuddyAllocator(self.capacity)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._ready = threading.Event()
        self._registered: list[int] = []  # offsets of the parts page-locked so far
        self.error: str | None = None
        self.in_use = self.peak = self.full = self.not_ready = 0
        # Address space only: pages are committed when pinned.
        self._map = mmap.mmap(-1, self._buddy.total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._arena = torch.frombuffer(self._map, dtype=torch.uint8)
        self._thread = threading.Thread(
            target=self._prepare, args=(device,), name="kvbridge-pin", daemon=True
        )
        self._started = False
        if wait:
            self.wait_ready()

    def prepare(self) -> None:
        """Start pinning the arena in the background (idempotent; returns at once)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self._thread.start()

    def _prepare(self, device: torch.device | None) -> None:
        """Register the parts, smallest first, and hand each to the allocator once it is."""
        try:
            for offset, size in reversed(self._buddy.parts):
                if self._closing.is_set():
                    return
                if device is not None:
                    _register(self._arena.data_ptr() + offset, size, device)
                with self._lock:
                    self._registered.append(offset)
                    self._buddy.add_part(offset, size)
        except Exception as exc:  # the pool stays as far as it got; the rest goes the direct path
            self.error = f"{type(exc).__name__}: {exc}"
            logger.error("kvbridge: the pinned staging pool could not be prepared: %s", self.error)
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether the whole arena is prepared (starts it, and waits up to ``timeout``)."""
        self.prepare()
        return self._ready.wait(timeout)

    size_class = staticmethod(size_class)

    def fits(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` can ever be had from this pool."""
        return self.fits_together([nbytes])

    def fits_together(self, sizes: Sequence[int]) -> bool:
        """Whether buffers of all of ``sizes`` can ever be had at once."""
        if self.error is not None:  # what failed to pin never joins: only the parts that did
            with self._lock:
                parts = [(o, n) for o, n in self._buddy.parts if o in self._registered]
            return self._buddy.fits_together(sizes, parts)
        return self._buddy.fits_together(sizes)

    def acquire(self, nbytes: int) -> StagingBuffer | None:
        """A buffer of ``nbytes``, or None while the pool has no room for it (or is not ready)."""
        if not self.fits(nbytes):
            raise ValueError(f"{nbytes} bytes never fit a staging arena of {self._buddy.total} bytes")
        self.prepare()
        with self._lock:
            offset = self._buddy.alloc(nbytes)
            if offset is None:
                if self._ready.is_set():
                    self.full += 1
                else:
                    self.not_ready += 1
                return None
            size = size_class(nbytes)
            self.in_use += size
            self.peak = max(self.peak, self.in_use)
        return StagingBuffer(self, self._arena[offset : offset + size], nbytes)

    def _give_back(self, block: torch.Tensor) -> None:
        with self._lock:
            self.in_use -= self._buddy.free(block.data_ptr() - self._arena.data_ptr())

    def stats(self) -> dict[str, Any]:
        with self._lock:
            parts = dict(self._buddy.parts)
            return {
                "capacity": self.capacity,
                "pinned": self.pinned,
                "in_use": self.in_use,
                "allocated": sum(parts[o] for o in self._registered),  # page-locked bytes
                "peak": self.peak,
                "full": self.full,
                "not_ready": self.not_ready,
                "error": self.error,
            }

    def close(self) -> None:
        """Unlock the arena (copies into it must have completed); idempotent. Buffers still
        referenced keep their memory mapped, no longer pinned."""
        self._closing.set()
        with self._lock:
            started = self._started
        if started:
            self._thread.join()
        with self._lock:
            registered, self._registered = self._registered, []
        if self.pinned:
            for offset in registered:
                _unregister(self._arena.data_ptr() + offset)
