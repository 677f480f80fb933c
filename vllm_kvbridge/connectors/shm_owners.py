"""Crash-safe shared memory: owner locks of runs, and a host-wide reaper of dead owners' names.

Why: a process killed by SIGKILL runs none of its clean-up, so what it created in
``/dev/shm`` stays for good unless somebody else can tell it is dead. A pid cannot tell:
processes of one host that share ``/dev/shm`` (the containers of one pod, ``unshare``) do not
share pid numbers, so a pid written by one means nothing, or another live process, to the
next. A held lock can: the kernel drops it when its holder dies, however it dies, and every
PID namespace sees it.

The owner lock. Every process of a run that creates shared memory (the orchestrator, each
stage process; see :func:`hold_owner`) holds an exclusive ``flock`` on its own small owner
file, ``/dev/shm/kvbridge-owner.<run>.<tag>``, for its lifetime. The file is created unnamed
(``O_TMPFILE``), locked, given its header, and only then linked under its name, so no owner
file is ever seen unlocked while its owner lives. Its lines (JSON) are a header (run, role,
pid: for operators only) and the names the owner recorded, each with its inode.

What it records (:meth:`ShmOwner.record_mapped`): names vLLM and Python's multiprocessing
create and cannot remove when killed, vLLM's message queues (``psm_*``) and multiprocessing's
named semaphores (``sem.mp-*``), as seen in ``/proc/<pid>/maps`` of the owner and its
descendants (vLLM's engine core and workers: a queue or semaphore is mapped for as long as it
is used). Names that existed before the owner took its lock are never recorded: it cannot
have created them. Our own segments (``kvbridge.*``) are not recorded: each holds its own
owner lock (:mod:`~vllm_kvbridge.connectors.shm_segments`).

The reaper (:func:`reap_dead_runs`; any process on the host, in any PID namespace; also
``python -m vllm_kvbridge.connectors.shm_owners``) removes exactly:

* ``kvbridge.<run>-<edge>.*`` segments whose own owner lock nobody holds (the connectors'
  rule, :func:`~vllm_kvbridge.connectors.shm_segments.reap_stale`) of runs that have a dead
  owner file (other namespaces only when asked: ``every_namespace``);
* a name recorded by an owner whose lock it can take (the owner is dead), unless a live owner
  recorded it too, the name now is another file (another inode), or a live process this
  reaper can see still maps it. Names kept for that last reason stay in the dead owner's file
  and are retried by the next reap (an engine core that outlives its killed stage process for
  a moment); names of other users' processes cannot be unlinked by us anyway (``/dev/shm`` is
  sticky);
* the dead owner's file, once nothing of it is kept and its run has no segment left (one
  held by a live process, e.g. the vLLM worker of a killed stage: the file is what makes a
  later reap look at that run again).

Nothing else: a ``psm_*`` or ``sem.mp-*`` name that no dead owner recorded is never touched,
whoever made it. While a reaper holds a dead owner's lock, other reapers take that owner for
alive and skip it, so concurrent reapers never both work on one owner.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import TracebackType

from vllm_kvbridge import procfs
from vllm_kvbridge.connectors import shm_segments
from vllm_kvbridge.errors import ConfigError

__all__ = [
    "OWNER_PREFIX",
    "RECORDED_NAME",
    "RUN_ID_ENV",
    "OwnerInfo",
    "ShmOwner",
    "all_mapped",
    "hold_owner",
    "mapped_files",
    "names_mapped_by",
    "owners",
    "reap_dead_runs",
    "unlink_if_unused",
]

SHM_DIR = shm_segments.SHM_DIR
#: Owner files are ``<OWNER_PREFIX><run>.<tag>``; not ``kvbridge.``, which names segments.
OWNER_PREFIX = "kvbridge-owner."
#: The environment variable a run's processes find its run id in (see :func:`hold_owner`).
RUN_ID_ENV = "VLLM_KVBRIDGE_RUN_ID"
#: The only names besides our segments that are ever recorded, so ever reaped: Python's
#: ``SharedMemory`` (``psm_`` + hex; vLLM's message queues), multiprocessing's named
#: semaphores (``sem.mp-`` + ``[a-z0-9_]``; what ``sem_open("/mp-...")`` creates) and a
#: stage's engine progress board while its engine starts (:mod:`vllm_kvbridge.runner.progress`).
RECORDED_NAME = re.compile(
    r"psm_[0-9a-f]{1,64}|sem\.mp-[a-z0-9_]{1,64}|kvbridge-progress\.[0-9]{1,10}\.[0-9a-f]{12}"
)
#: No "-": a segment namespace is "<run id>-<edge>", split at its first "-".
_RUN_ID = re.compile(r"[A-Za-z0-9_]{1,48}")
#: An owner file with no complete header is being created (only without ``O_TMPFILE``, where
#: name and lock are two steps) if younger than this; older, its creator died in between.
_CREATING_GRACE_S = 10.0


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(f"run id {run_id!r} must match [A-Za-z0-9_]{{1,48}}")
    return run_id


def _listdir(shm_dir: str) -> list[str]:
    try:
        return os.listdir(shm_dir)
    except FileNotFoundError:
        return []


def _names(shm_dir: str, wanted: Callable[[str], object]) -> dict[str, tuple[int, int]]:
    """``{name: (device, inode)}`` of the names in ``shm_dir`` that ``wanted`` accepts."""
    found = {}
    for name in _listdir(shm_dir):
        if wanted(name):
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(shm_dir, name))
                found[name] = (st.st_dev, st.st_ino)
    return found


def _recordable(shm_dir: str) -> dict[str, tuple[int, int]]:
    """``{name: (device, inode)}`` of the names in ``shm_dir`` that owners may record."""
    return _names(shm_dir, RECORDED_NAME.fullmatch)


def names_mapped_by(
    pids: Iterable[int | str], shm_dir: str, wanted: Callable[[str], object]
) -> dict[str, int]:
    """``{name: inode}`` of the names in ``shm_dir`` (those ``wanted`` accepts) whose files
    ``pids`` map. By inode, not by the path in the maps: glibc's sem_open maps a temporary
    name that it then links as ``sem.mp-*`` and unlinks, so the maps show
    ``sem.XXXXXX (deleted)``."""
    mapped: set[tuple[int, int]] = set()
    for pid in pids:
        mapped |= mapped_files(pid, shm_dir)
    return {name: ino for name, (dev, ino) in _names(shm_dir, wanted).items() if (dev, ino) in mapped}


class ShmOwner:
    """This process's owner lock for run ``run_id`` (see the module docstring).

    Hold it for the process's lifetime; :meth:`release` at a clean stop. A child made with
    ``fork`` shares the lock (so the owner counts as alive while it lives, which is the safe
    side) but cannot record or release: only the process that took it does.
    """

    def __init__(self, run_id: str, role: str = "", *, shm_dir: str = SHM_DIR) -> None:
        self.run_id = _check_run_id(run_id)
        self.role = role
        self.shm_dir = shm_dir
        self.path = os.path.join(shm_dir, f"{OWNER_PREFIX}{run_id}.{secrets.token_hex(6)}")
        self._pid = os.getpid()
        # Names present now were not created by this owner: never record them (see record()).
        self._before = {name: ino for name, (_dev, ino) in _recordable(shm_dir).items()}
        self._recorded: dict[str, int] = {}
        header = json.dumps({"run": run_id, "role": role, "pid": self._pid, "t": time.time()})
        self._fd = _create_locked(self.path, shm_dir, (header + "\n").encode())
        self._end = os.fstat(self._fd).st_size

    @property
    def recorded(self) -> frozenset[str]:
        """The names recorded so far."""
        return frozenset(self._recorded)

    def record(self, names: Iterable[str]) -> list[str]:
        """Record ``names`` (in ``shm_dir``) as this owner's; returns those newly recorded.

        Only names matching :data:`RECORDED_NAME` that exist now and did not exist (as the same
        file) when the lock was taken are recorded: anything else is not ours to reap.
        """
        found = {}
        for name in names:
            with contextlib.suppress(OSError):
                found[name] = os.lstat(os.path.join(self.shm_dir, name)).st_ino
        return self._record(found)

    def record_mapped(self, *, descendants: bool = True) -> list[str]:
        """Record the names this process (and its descendants) map; returns those newly recorded.

        Call it once the engine is up (vLLM creates its queues and semaphores at start) and
        then every few seconds: a name created and lost between two calls is not recorded.
        """
        pids = [self._pid, *(procfs.descendants(self._pid) if descendants else [])]
        return self._record(names_mapped_by(pids, self.shm_dir, RECORDED_NAME.fullmatch))

    def _record(self, found: dict[str, int]) -> list[str]:
        if os.getpid() != self._pid or self._fd < 0:
            return []
        new = [
            (name, ino)
            for name, ino in sorted(found.items())
            if RECORDED_NAME.fullmatch(name)
            and self._before.get(name) != ino
            and self._recorded.get(name) != ino
        ]
        if not new:
            return []
        data = "".join(json.dumps({"n": name, "i": ino}) + "\n" for name, ino in new).encode()
        # One write per call: a reader sees whole lines, or a torn last one it skips.
        os.pwrite(self._fd, data, self._end)
        self._end += len(data)
        self._recorded.update(new)
        return [name for name, _ in new]

    def release(self) -> list[str]:
        """A clean stop: reap what this owner recorded that nothing maps any more, remove the
        owner file and drop the lock. Returns the names removed. Idempotent; a no-op in a
        forked child."""
        if self._fd < 0 or os.getpid() != self._pid:
            return []
        removed = []
        mapped = all_mapped(self.shm_dir) if self._recorded else set()
        for name, ino in self._recorded.items():
            if unlink_if_unused(self.shm_dir, name, ino, mapped) == "removed":
                removed.append(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # before dropping the lock: no reaper sees it unlocked
        os.close(self._fd)
        self._fd = -1
        return removed

    def __enter__(self) -> ShmOwner:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def hold_owner(run_id: str | None = None, role: str = "", *, shm_dir: str = SHM_DIR) -> ShmOwner:
    """Take this process's owner lock for ``run_id`` (default: ``$VLLM_KVBRIDGE_RUN_ID``)."""
    run_id = run_id if run_id is not None else os.environ.get(RUN_ID_ENV, "")
    return ShmOwner(run_id, role, shm_dir=shm_dir)


def _create_locked(path: str, shm_dir: str, header: bytes) -> int:
    """An owner file under ``path``, locked and holding ``header`` before the name exists."""
    try:
        fd = os.open(shm_dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, header, 0)
            # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names the unnamed file (see
            # shm_segments._create_unnamed_locked for why os.link needs the dir fd).
            proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.link(str(fd), path, src_dir_fd=proc_fds, follow_symlinks=True)
            finally:
                os.close(proc_fds)
            return fd
        except OSError:
            os.close(fd)  # no /proc: the two-step way below
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, header, 0)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    return fd


# -- what processes map ---------------------------------------------------------------------


def _maps_lines(pid: int | str) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return f.read().splitlines()
    except OSError:  # gone, or another user's: see the module docstring
        return []


def mapped_files(pid: int | str, shm_dir: str) -> set[tuple[int, int]]:
    """``(device, inode)`` of the files in ``shm_dir`` that process ``pid`` maps (named or
    not any more: a name may have been linked to the file after it was mapped)."""
    prefix = os.path.realpath(shm_dir).encode() + b"/"
    found = set()
    for line in _maps_lines(pid):
        fields = line.split(maxsplit=5)  # address perms offset dev inode path
        if len(fields) < 6 or not fields[5].startswith(prefix):
            continue
        with contextlib.suppress(ValueError):
            major, minor = (int(x, 16) for x in fields[3].split(b":"))
            found.add((os.makedev(major, minor), int(fields[4])))
    return found


def all_mapped(shm_dir: str) -> set[tuple[int, int]]:
    """``(device, inode)`` of every file in ``shm_dir`` a process this one can see maps."""
    mapped: set[tuple[int, int]] = set()
    for entry in _listdir("/proc"):
        if entry.isdigit():
            mapped |= mapped_files(entry, shm_dir)
    return mapped


def unlink_if_unused(shm_dir: str, name: str, ino: int, mapped: set[tuple[int, int]]) -> str:
    """Unlink ``name`` if it still is inode ``ino`` and nothing maps it: ``"removed"``,
    ``"gone"`` (no such file any more) or ``"in use"`` (kept)."""
    path = os.path.join(shm_dir, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "gone"
    if st.st_ino != ino or not stat.S_ISREG(st.st_mode):
        return "gone"  # another file has the name now: not the one recorded
    if (st.st_dev, st.st_ino) in mapped:
        return "in use"
    try:
        os.unlink(path)
    except FileNotFoundError:
        return "gone"
    except PermissionError:
        return "gone"  # another user's name (sticky /dev/shm): never ours
    return "removed"


# -- owner files ----------------------------------------------------------------------------


@dataclass
class OwnerInfo:
    """One owner file as a reaper reads it."""

    file: str
    run: str | None
    role: str
    pid: int | None  # in the owner's PID namespace: for operators, never for liveness
    alive: bool
    names: dict[str, int] = field(default_factory=dict)  # recorded name -> inode


def _parse(raw: bytes) -> tuple[dict | None, dict[str, int]]:
    header, names = None, {}
    for i, line in enumerate(raw.split(b"\n")):
        try:
            item = json.loads(line)
        except ValueError:
            continue  # a torn last line of an owner killed while writing it
        if i == 0 and isinstance(item, dict) and "run" in item:
            header = item
        elif isinstance(item, dict) and isinstance(item.get("n"), str) and isinstance(item.get("i"), int):
            names[item["n"]] = item["i"]
    return header, names


def _read_all(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _owner_files(shm_dir: str, prefix: str) -> list[str]:
    return sorted(n for n in _listdir(shm_dir) if n.startswith(f"{OWNER_PREFIX}{prefix}"))


def _open_owner(path: str) -> int | None:
    for flags in (os.O_RDWR, os.O_RDONLY):  # read-only still locks: only rewriting needs more
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except PermissionError:
            continue
    return None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def owners(shm_dir: str = SHM_DIR, prefix: str = "") -> list[OwnerInfo]:
    """The owner files of runs whose id starts with ``prefix`` (for operators and tests).
    ``alive`` is whether the owner's lock is held now (by it, or by a reaper at work)."""
    infos = []
    for name in _owner_files(shm_dir, prefix):
        fd = _open_owner(os.path.join(shm_dir, name))
        if fd is None:
            continue
        try:
            alive = not _try_lock(fd)  # taken for a moment if dead; closing drops it
            header, names = _parse(_read_all(fd))
        finally:
            os.close(fd)
        header = header or {}
        infos.append(
            OwnerInfo(name, header.get("run"), header.get("role", ""), header.get("pid"), alive, names)
        )
    return infos


def reap_dead_runs(shm_dir: str = SHM_DIR, *, prefix: str = "", every_namespace: bool = False) -> list[str]:
    """Remove what dead owners left in ``shm_dir`` (see the module docstring); returns the
    names removed, sorted (dead owners' files included).

    ``prefix`` limits it to the runs whose id starts with it. Segments are reaped in the
    namespaces of the runs that have a dead owner file and no live one (the pipeline names an
    edge's namespace ``<run id>-<edge>``); ``every_namespace`` reaps dead segments in every namespace instead
    (what runs from before owner files left; other users of the connectors included). Safe at
    any time, from any process and PID namespace: live owners' names are never touched.
    """
    removed: list[str] = []
    live_names: set[str] = set()
    dead: list[tuple[str, int, dict[str, int]]] = []  # (owner file, its locked fd, names)
    live_runs: set[str] = set()
    try:
        for name in _owner_files(shm_dir, prefix):
            path = os.path.join(shm_dir, name)
            fd = _open_owner(path)
            if fd is None:
                continue
            try:
                locked = _try_lock(fd)
                st = os.fstat(fd)
                header, names = _parse(_read_all(fd))
            except BaseException:
                os.close(fd)
                raise
            creating = header is None and time.time() - st.st_ctime < _CREATING_GRACE_S
            if not locked or creating:
                live_names.update(names)
                live_runs.add(_run_of(name))
                os.close(fd)
            elif st.st_nlink == 0:
                os.close(fd)  # another reaper finished it between our open and our lock
            else:
                dead.append((name, fd, names))  # its lock stays ours until it is done
        if dead or every_namespace:
            # Only runs with no live process: a live run's dead stage may have published
            # segments its consumers still read (shared memory outlives its sender); that
            # run's orchestrator reaps its own edges.
            dead_runs = {_run_of(owner_file) for owner_file, _, _ in dead} - live_runs
            removed += _reap_segments(shm_dir, None if every_namespace else dead_runs)
        mapped = all_mapped(shm_dir) if any(names for _, _, names in dead) else set()
        segments_left = {_run_of_segment(n) for n in _listdir(shm_dir)}
        for owner_file, fd, names in dead:
            kept = {}
            for name, ino in names.items():
                if name in live_names:
                    continue  # a live owner recorded it too: it is that owner's to reap
                outcome = unlink_if_unused(shm_dir, name, ino, mapped)
                if outcome == "removed":
                    removed.append(name)
                elif outcome == "in use":
                    kept[name] = ino
            if kept or _run_of(owner_file) in segments_left:
                # Retried by the next reap: a name still mapped (an engine core outliving its
                # stage for a moment), or the run's segments still held by a live process
                # (a stage's vLLM worker): the file is what tells a later reaper to look.
                _rewrite(fd, kept)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(shm_dir, owner_file))
                    removed.append(owner_file)
    finally:
        for _, fd, _ in dead:
            os.close(fd)
    return sorted(removed)


def _run_of(owner_file: str) -> str:
    return owner_file[len(OWNER_PREFIX) :].rsplit(".", 1)[0]


def _run_of_segment(name: str) -> str | None:
    """The run of a ``kvbridge.<run>-<edge>.*`` segment name (None: not one)."""
    parts = name.split(".")
    if len(parts) < 3 or parts[0] != shm_segments.PREFIX or "-" not in parts[1]:
        return None
    return parts[1].split("-", 1)[0]


def _rewrite(fd: int, kept: dict[str, int]) -> None:
    """Leave only ``kept`` in a dead owner's file (we hold its lock: nobody else writes it)."""
    header, _ = _parse(_read_all(fd))
    lines = [json.dumps(header or {"run": None})] + [json.dumps({"n": n, "i": i}) for n, i in kept.items()]
    with contextlib.suppress(OSError):  # opened read-only (another user's): keep it whole
        data = ("\n".join(lines) + "\n").encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))


def _reap_segments(shm_dir: str, runs: set[str] | None) -> list[str]:
    """Dead segments (their own lock free) of ``runs``' namespaces; every namespace if None."""
    if runs is None:
        return shm_segments.reap_stale(None, shm_dir=shm_dir)
    removed = []
    namespaces = {n.split(".")[1] for n in _listdir(shm_dir) if _run_of_segment(n) in runs}
    for namespace in sorted(namespaces):
        removed += shm_segments.reap_stale(namespace, shm_dir=shm_dir)
    return removed


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_kvbridge.connectors.shm_owners [--shm-dir DIR] [--prefix RUN]``:
    reap for dead runs and print each name removed."""
    import argparse

    parser = argparse.ArgumentParser(description="remove what dead vllm-kvbridge runs left in /dev/shm")
    parser.add_argument("--shm-dir", default=SHM_DIR)
    parser.add_argument("--prefix", default="", help="only runs whose id starts with this")
    parser.add_argument(
        "--every-namespace", action="store_true", help="dead segments of every namespace, not only runs'"
    )
    args = parser.parse_args(argv)
    for name in reap_dead_runs(args.shm_dir, prefix=args.prefix, every_namespace=args.every_namespace):
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
