"""Pools of host buffers registered with a transfer engine (Mooncake store or transfer engine).

Registration tells an engine it may read/write the memory directly; on RDMA it pins the
pages, which is slow, so buffers ("slabs") are kept and reused instead of being registered
per transfer. At most ``keep_bytes`` stay pooled; bigger demand is served by slabs that are
unregistered and freed on release.

The pool only knows two callables, ``register(ptr, nbytes) -> rc`` and
``unregister(ptr) -> rc`` (0 is success), so the Mooncake store (``register_buffer``) and the
transfer engine (``register_memory``) share it; the ZMQ connector pools its send buffers
with both no-ops (plain memory, kept so that reuse finds its pages already faulted in).

A slab may be *lent* for a long time: a receiver decodes in place, so the payload's tensors
view the slab, and :meth:`RegisteredBufferPool.lend_view` returns it to the pool only when
the last of them is freed. :meth:`RegisteredBufferPool.close` unregisters every slab, lent
or free, at once (the engine is going away); a lent slab's memory then stays valid for the
tensors that view it, and its later release is a no-op.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import numpy as np

from vllm_kvbridge.errors import TransferError

MIN_SLAB = 1 << 20


def _closed_pool(*_: int) -> int:
    return -1


class RegisteredBufferPool:
    """Registered slabs of at least :data:`MIN_SLAB` bytes (powers of two), reused across transfers."""

    def __init__(
        self,
        register: Callable[[int, int], int],
        unregister: Callable[[int], int],
        keep_bytes: int,
        what: str = "Mooncake",
    ) -> None:
        self._register = register
        self._unregister = unregister
        self._keep: int | None = keep_bytes
        self._what = what
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._lent: dict[int, tuple[np.ndarray, bool]] = {}  # id(slab) -> (slab, pooled)
        self._pooled = 0  # bytes of every slab the pool owns (free or lent)
        #: slabs registered so far: a pool that reuses its slabs registers a few, once
        self.registrations = 0

    def acquire(self, need: int) -> tuple[np.ndarray, bool]:
        """A registered slab of at least ``need`` bytes and whether it belongs to the pool."""
        with self._lock:
            if self._keep is None:
                raise TransferError(f"{self._what} buffer pool is closed")
            best, at = None, -1
            for i, slab in enumerate(self._free):
                fits = need <= slab.nbytes <= max(2 * need, MIN_SLAB)
                if fits and (best is None or slab.nbytes < best.nbytes):
                    best, at = slab, i
            if best is not None:
                # By position: list.remove compares arrays with ==, elementwise (an error,
                # or a wrong match, as soon as two slabs are free).
                del self._free[at]
                self._lent[id(best)] = (best, True)
                return best, True
        capacity = max(MIN_SLAB, 1 << (need - 1).bit_length())
        slab = np.empty(capacity, dtype=np.uint8)
        rc = self._register(slab.ctypes.data, slab.nbytes)
        if rc != 0:
            raise TransferError(f"{self._what} registration of {capacity} bytes failed (rc={rc})")
        with self._lock:
            self.registrations += 1
            if self._keep is None:  # closed meanwhile
                self._unregister(slab.ctypes.data)
                raise TransferError(f"{self._what} buffer pool is closed")
            self._lent[id(slab)] = (slab, False)
        return slab, False

    def release(self, slab: np.ndarray, pooled: bool | None = None) -> None:
        """Give back a slab from :meth:`acquire` (``pooled`` is ignored: the pool remembers)."""
        with self._lock:
            entry = self._lent.pop(id(slab), None)
            if entry is None:  # released twice, or the pool was closed since: nothing to do
                return
            pooled = entry[1]
            if self._keep is not None and (pooled or self._pooled + slab.nbytes <= self._keep):
                if not pooled:
                    self._pooled += slab.nbytes
                self._free.append(slab)
                return
            if pooled:
                self._pooled -= slab.nbytes
        self._unregister(slab.ctypes.data)

    def discard(self, slab: np.ndarray) -> None:
        """Unregister a lent slab and never reuse it (a peer may still hold its address)."""
        with self._lock:
            entry = self._lent.pop(id(slab), None)
            if entry is None:
                return
            if entry[1]:
                self._pooled -= slab.nbytes
        self._unregister(slab.ctypes.data)

    def lend_view(self, slab: np.ndarray, nbytes: int) -> np.ndarray:
        """A uint8 view of ``slab[:nbytes]`` whose death (and that of every view of it)
        releases ``slab`` to the pool.

        The view is built over a memoryview, not sliced from ``slab``: numpy collapses the
        ``base`` of a slice of a slice to the array owning the memory, so a finalizer on a
        plain slice would fire while tensors still viewed it.
        """
        view = np.frombuffer(memoryview(slab), dtype=np.uint8, count=nbytes)
        weakref.finalize(view, self.release, slab)
        return view

    def close(self) -> None:
        """Unregister every slab (free and lent); later releases are no-ops."""
        with self._lock:
            slabs = self._free + [slab for slab, _ in self._lent.values()]
            self._free, self._lent, self._keep = [], {}, None
            self._pooled = 0
            unregister = self._unregister
            # Drop the engine's bound methods: finalizers of lent slabs keep this pool alive
            # for as long as their tensors live, and must not keep the engine alive too.
            self._register = self._unregister = _closed_pool
        for slab in slabs:
            unregister(slab.ctypes.data)

    @property
    def pooled_bytes(self) -> int:
        with self._lock:
            return self._pooled

    @property
    def lent(self) -> int:
        """Slabs currently out (held by a put in progress or by a receiver's tensors)."""
        with self._lock:
            return len(self._lent)

    @property
    def registered_bytes(self) -> int:
        """Bytes registered with the engine right now (free and lent slabs)."""
        with self._lock:
            return sum(s.nbytes for s in self._free) + sum(s.nbytes for s, _ in self._lent.values())


__all__ = ["MIN_SLAB", "RegisteredBufferPool"]
