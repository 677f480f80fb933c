"""What ``/proc`` says about processes: the one reader of ``/proc/<pid>/stat``.

Used by the shared-memory reaper (which names a process and its descendants map), the stage
supervisor (which processes of a stage's group are alive) and a stage's liveness check (which
of its engine processes are stopped). Linux only; a process that is gone, or not readable by
us, is skipped rather than raised about: these are all best-effort views of live processes.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["STOPPED_STATES", "descendants", "group_pids", "state"]

#: ``/proc/<pid>/stat`` states of a process that cannot run until someone resumes it:
#: ``T`` (stopped by a signal: SIGSTOP, SIGTSTP) and ``t`` (stopped by a tracer).
STOPPED_STATES = frozenset("Tt")


def _fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # The name (field 2) is in parens and may hold spaces and parens itself.
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _pids() -> list[str]:
    try:
        return [e for e in os.listdir("/proc") if e.isdigit()]
    except FileNotFoundError:
        return []


def state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T``, ``Z``, ...), None when it is gone."""
    fields = _fields(pid)
    return fields[0].decode() if fields else None


def descendants(root: int) -> list[int]:
    """The pids of ``root``'s descendants, children before their own children."""
    children: dict[int, list[int]] = {}
    for entry in _pids():
        fields = _fields(entry)
        with contextlib.suppress(ValueError, IndexError, TypeError):
            children.setdefault(int(fields[1]), []).append(int(entry))  # type: ignore[index]
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def group_pids(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` (zombies included)."""
    found = []
    for entry in _pids():
        fields = _fields(entry)
        with contextlib.suppress(ValueError, IndexError, TypeError):
            if int(fields[2]) == pgid:  # type: ignore[index]
                found.append(int(entry))
    return found
