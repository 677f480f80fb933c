"""Large host copies split across threads.

Why: one core's ``memcpy`` is far from what a host's memory can move. Every payload a
connector packs (shared memory, NIXL, Mooncake) is one copy of its bytes into the
transport's memory, and that copy was most of a 64 MB put: on the 2-core CI machine a
64 MB memmove runs at 7-9 GB/s on one thread and 14-16 GB/s on two (``bench connectors``'
memcpy ceiling uses the same routine, so it stays a ceiling). ``ctypes.memmove`` releases
the GIL, so the pieces run in parallel.

A copy of at least :data:`PARALLEL_COPY` bytes is cut into one piece per usable core (at
most :data:`MAX_THREADS`, each at least :data:`MIN_PIECE` bytes); the caller's thread
copies one piece itself and waits for the others on a small shared pool. Overlapping
ranges (memmove's other job) are copied whole, on the caller's thread. The pool is made
on first use and forgotten in a forked child (its threads do not exist there).
"""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["MAX_THREADS", "MIN_PIECE", "PARALLEL_COPY", "memmove"]

#: Copies at least this big are split (smaller ones cost more to hand out than they save).
PARALLEL_COPY = 8 << 20
#: The smallest piece one thread copies.
MIN_PIECE = 4 << 20
#: Threads per copy at most: memory bandwidth, not cores, bounds a copy beyond a few.
MAX_THREADS = 4
_ALIGN = 4096  # pieces start on page boundaries (whole pages per thread)

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what this process may run on (vLLM binds CPUs)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="kvbridge-copy")
        return _pool


def memmove(dst: int, src: int, nbytes: int) -> None:
    """``memmove(dst, src, nbytes)``, in parallel pieces when big (GIL released throughout)."""
    pieces = min(MAX_THREADS, _usable_cores(), nbytes // MIN_PIECE) if nbytes >= PARALLEL_COPY else 1
    if pieces < 2 or (dst < src + nbytes and src < dst + nbytes):
        ctypes.memmove(dst, src, nbytes)
        return
    step = -(-nbytes // pieces // _ALIGN) * _ALIGN
    pool = _threads()
    rest = [
        pool.submit(ctypes.memmove, dst + off, src + off, min(step, nbytes - off))
        for off in range(step, nbytes, step)
    ]
    ctypes.memmove(dst, src, min(step, nbytes))
    for f in rest:
        f.result()
