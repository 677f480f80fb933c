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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

__all__ = ["MAX_THREADS", "MIN_PIECE", "PARALLEL_COPY", "memmove", "memmove_many"]

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


def _pieces(nbytes: int) -> int:
    return min(MAX_THREADS, _usable_cores(), nbytes // MIN_PIECE) if nbytes >= PARALLEL_COPY else 1


def memmove(dst: int, src: int, nbytes: int) -> None:
    """``memmove(dst, src, nbytes)``, in parallel pieces when big (GIL released throughout)."""
    pieces = _pieces(nbytes)
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


def _copy_all(copies: list[tuple[int, int, int]]) -> None:
    for dst, src, nbytes in copies:
        ctypes.memmove(dst, src, nbytes)


def memmove_many(copies: Sequence[tuple[int, int, int]]) -> None:
    """Every ``(dst, src, nbytes)`` of ``copies``, split across threads by bytes in all.

    Why: a payload is many buffers (a KV payload is two per layer, often 1-2 MiB each),
    each under :data:`PARALLEL_COPY`: copied one by one, a 64 MB payload went at one
    core's speed. Together they are cut into equal shares of bytes, one per thread (a
    buffer may be split between two), so the pack runs as fast as one big copy. The
    destinations must not overlap each other or any source (a pack's never do).
    """
    total = sum(n for _, _, n in copies)
    pieces = _pieces(total)
    if pieces < 2:
        _copy_all([c for c in copies if c[2]])
        return
    share = -(-total // pieces)
    shares: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for dst, src, nbytes in copies:
        off = 0
        while off < nbytes:
            if room == 0:
                shares.append([])
                room = share
            n = min(room, nbytes - off)
            shares[-1].append((dst + off, src + off, n))
            off += n
            room -= n
    pool = _threads()
    rest = [pool.submit(_copy_all, s) for s in shares[1:]]
    _copy_all(shares[0])
    for f in rest:
        f.result()
