"""The progress board: how a stage process sees that its vLLM engine still makes steps.

Why: a stage's heartbeat comes from the stage process, but its engine core and workers are
other processes. A stopped, deadlocked or wedged engine process leaves the stage process
beating while every request in it waits forever (issue 36, item 2). The board is a small
shared file of slots; every engine process that takes part in a step (the scheduler in the
engine core, each worker rank) writes the time of its latest step into a slot of its own,
and the stage process reads how long ago the laggard did (:func:`read_ages`).

Layout: :data:`SLOTS` slots of 16 bytes, ``(pid: int64, monotonic time: float64)``, slot 0
first. ``CLOCK_MONOTONIC`` is one clock for every process of a host, so the times compare.
A process claims the first free slot once, under an ``flock`` of the file (the only lock:
writes after that are single aligned 8-byte stores, atomic on the hosts vLLM runs on).

The stage process creates the board (:func:`create`) and names it in
:data:`PROGRESS_ENV` before it builds its engine; vLLM's processes inherit the environment
and open it when their KV connector is built (:func:`open_from_env`, in both roles), so
the name can be removed as soon as the engine is up. A process with no board (a stock
``vllm serve``, a test engine) finds none in its environment and :func:`touch` does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import struct
import time

__all__ = ["PROGRESS_ENV", "SLOTS", "create", "open_from_env", "read_ages", "touch"]

#: The environment variable that names the board to the engine's processes.
PROGRESS_ENV = "VLLM_KVBRIDGE_PROGRESS"
#: Slots per board: the engine core's scheduler plus one per worker rank, with room to spare.
SLOTS = 256
_SLOT = struct.Struct("=qd")
SIZE = SLOTS * _SLOT.size
#: A process writes its slot at most this often (seconds): a busy engine core steps
#: thousands of times a second while it waits for conditioning rows.
TOUCH_EVERY_S = 0.01
#: Boards live in /dev/shm as ``<PREFIX><pid>.<random>``; the shared-memory owner of the
#: stage records the name, so a stage killed before it removed it leaves nothing behind.
PREFIX = "kvbridge-progress."


def create(shm_dir: str = "/dev/shm") -> tuple[str, mmap.mmap]:
    """A new board (every slot free) and its path; the caller removes the path."""
    path = os.path.join(shm_dir, f"{PREFIX}{os.getpid()}.{secrets.token_hex(6)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, SIZE)
        return path, mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)


def read_ages(board: mmap.mmap, now: float | None = None) -> dict[int, float]:
    """``{pid: seconds since its latest step}`` of every process that claimed a slot."""
    now = time.monotonic() if now is None else now
    ages = {}
    for i in range(SLOTS):
        pid, at = _SLOT.unpack_from(board, i * _SLOT.size)
        if pid == 0:
            break  # slots are claimed in order
        ages[pid] = max(0.0, now - at)
    return ages


class _Writer:
    """This process's slot on the board it found in its environment."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            self._map = mmap.mmap(fd, SIZE)
            fcntl.flock(fd, fcntl.LOCK_EX)  # claim a slot: the other processes claim too
            try:
                pid, self._offset = os.getpid(), -1
                for i in range(SLOTS):
                    owner, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
                    if owner in (0, pid):
                        self._offset = i * _SLOT.size
                        break
                if self._offset < 0:
                    raise RuntimeError(f"progress board {path} has no free slot ({SLOTS} taken)")
                _SLOT.pack_into(self._map, self._offset, pid, time.monotonic())
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        self._at_offset = self._offset + 8
        self._last = 0.0

    def touch(self) -> None:
        now = time.monotonic()
        if now - self._last >= TOUCH_EVERY_S:
            self._last = now
            struct.pack_into("=d", self._map, self._at_offset, now)


_writer: _Writer | None = None


def _forget_in_child() -> None:
    # A forked child (vLLM's fork-started workers) must claim a slot of its own, not write
    # its parent's: its connector's open_from_env claims one.
    global _writer
    _writer = None


os.register_at_fork(after_in_child=_forget_in_child)


def open_from_env() -> None:
    """Take this process's slot on the board named in :data:`PROGRESS_ENV` (if any); once
    per process. A board already removed (an engine process started after the engine was
    up) is no error: that process is just not watched."""
    global _writer
    path = os.environ.get(PROGRESS_ENV)
    if _writer is None and path:
        with contextlib.suppress(FileNotFoundError):
            _writer = _Writer(path)


def touch() -> None:
    """This process made a step: record the time (no-op without a board)."""
    if _writer is not None:
        _writer.touch()
