"""Wait for a name to appear in a directory (Linux inotify), instead of polling for it.

The shared-memory connector publishes a payload by linking its segment to the key's name
in ``/dev/shm``; a receiver that waits for it used to retry on a timer (50 us doubling to
1 ms: ~0.9 ms p50 for a 1 KB handoff where the copy takes 0.05 ms). A :class:`DirWatch`
sleeps in ``poll`` on an inotify descriptor watching the directory for created and
moved-in names, and wakes when the awaited one appears.

Watches are pooled (:class:`WatchPool`, one per connector), not opened per wait: closing an
inotify descriptor waits for a kernel grace period (~3 ms measured here), which a get
that closed its watch paid on every handoff.

It is an accelerator, never the only way a payload is found: :meth:`DirWatch.open` returns
None where inotify is unavailable (not Linux, the per-user instance limit reached), and the
caller then polls on its timer; the caller also retries after every wake and timeout, so a
lost or coalesced event (the queue overflowed) costs at most its poll interval.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import select
import struct
import threading
import time

_IN_CREATE = 0x100
_IN_MOVED_TO = 0x80
_IN_Q_OVERFLOW = 0x4000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name
#: How often a watched wait tries again anyway (what a lost event costs at most).
RETRY_S = 0.05


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):
        return None


class DirWatch:
    """An inotify watch of one directory's new names (a context manager; one thread)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def open(cls, directory: str) -> DirWatch | None:
        """A watch of ``directory``, or None where inotify cannot watch it."""
        libc = _libc()
        if libc is None:
            return None
        fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return None  # e.g. EMFILE: fs.inotify.max_user_instances reached
        if libc.inotify_add_watch(fd, os.fsencode(directory), _IN_CREATE | _IN_MOVED_TO) < 0:
            os.close(fd)
            return None
        return cls(fd)

    def drain(self) -> None:
        """Drop the events queued so far (a pooled watch saw every name of the directory)."""
        try:
            while os.read(self._fd, 64 << 10):
                pass
        except BlockingIOError:
            pass

    def wait(self, name: str, timeout: float) -> bool:
        """Sleep until ``name`` is created or moved into the directory, or ``timeout``
        seconds pass; True when it (or an overflow, which may hide it) was seen."""
        target = os.fsencode(name)
        if not self._poll.poll(max(0, int(timeout * 1000) + 1)):
            return False
        seen = False
        while True:
            try:
                data = os.read(self._fd, 64 << 10)
            except BlockingIOError:
                return seen
            offset = 0
            while offset + _EVENT.size <= len(data):
                _, mask, _, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                if mask & _IN_Q_OVERFLOW or data[start : start + length].rstrip(b"\0") == target:
                    seen = True
                offset = start + length

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> DirWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WatchPool:
    """Idle :class:`DirWatch` es of one directory, reused by the waits of every thread.

    At most ``max_idle`` stay open: inotify instances are a per-user resource (128 by
    default, ``fs.inotify.max_user_instances``) shared with every other program of the user.
    """

    def __init__(self, directory: str, max_idle: int = 4) -> None:
        self.directory, self._max_idle = directory, max_idle
        self._lock = threading.Lock()
        self._idle: list[DirWatch] = []
        self._closed = False

    def checkout(self) -> DirWatch | None:
        """A watch with no events queued, or None where inotify cannot watch."""
        with self._lock:
            watch = self._idle.pop() if self._idle else None
        if watch is None:
            return DirWatch.open(self.directory)
        watch.drain()
        return watch

    def checkin(self, watch: DirWatch) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(watch)
                return
        watch.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for watch in idle:
            watch.close()


class ArrivalWait:
    """The sleeps of one receiver waiting for ``name`` in the pool's directory, between its
    tries; :meth:`close` returns the watch to the pool.

    The first :meth:`sleep` takes a watch and returns at once: the caller tries again
    before sleeping, since a name linked between its first try and the watch's start
    raised no event. Later ones sleep on the watch (trying again at least every
    :data:`RETRY_S`), or without inotify back off from 50 us to 1 ms.
    """

    def __init__(self, pool: WatchPool, name: str) -> None:
        self._pool, self._name = pool, name
        self._watch: DirWatch | None = None
        self._started = False
        self._delay = 0.00005

    def sleep(self, left: float) -> None:
        """Sleep at most ``left`` seconds, less when the name appears."""
        if not self._started:
            self._started = True
            self._watch = self._pool.checkout()
            if self._watch is not None:
                return
        if self._watch is not None:
            self._watch.wait(self._name, min(left, RETRY_S))
            return
        time.sleep(min(self._delay, left))
        self._delay = min(self._delay * 2, 0.001)

    def close(self) -> None:
        if self._watch is not None:
            self._pool.checkin(self._watch)
            self._watch = None
