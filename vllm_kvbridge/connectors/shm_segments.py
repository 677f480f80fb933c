"""POSIX shared-memory segments behind :class:`~vllm_kvbridge.connectors.shm.SharedMemoryConnector`.

Layout of a segment (a file in ``/dev/shm``)::

    [0, 4096)        header: magic, state, payload size, generation, owner pid, claimer pid,
                     publish time (ns), key length, lease end (ns), key bytes
    [4096, 4096+n)   the packed payload (``Encoded.pack_into``), page aligned

Names (every one starts with ``kvbridge.`` so an operator can tell them apart)::

    kvbridge.<ns>.p.<pid>.<tag>   a pool segment created by process <pid> (sender side)
    kvbridge.<ns>.k.<key>         a published payload: a second hard link to a pool segment
    kvbridge.<ns>.c.<pid>.<tag>   a receiver's claim name, alive for two syscalls

(``<tag>`` is random per process plus a counter: pids repeat across PID namespaces.)

Liveness (why it works across PID namespaces, e.g. the containers of one Kubernetes pod,
which share ``/dev/shm`` but not their pids): a pid in a name or header means nothing to a
peer in another namespace, so nothing is decided from pids. A segment's owner holds an
open-file-description lock (``F_OFD_SETLK``) on byte 0 of the segment for as long as it
lives, and every receiver holding a claimed payload a read lock on byte 1; the kernel drops
them when the process dies (a zombie included), and every namespace sees them
(``F_OFD_GETLK``). A pool segment is created unnamed (``O_TMPFILE``), locked, then linked
under its name, so no name is ever seen unlocked while its owner lives.

Protocol (why it is leak-free and needs no lock files):

* The sender keeps a pool of pre-faulted, mapped segments (fresh tmpfs pages cost ~10x a
  memcpy to fault in, reused ones cost nothing). A put writes the payload into a FREE
  segment, writes the header with the state word READY *last*, then publishes it with
  ``link(pool name, key name)``; ``link`` fails if the key exists, so publication is atomic.
* A receiver claims with ``rename(key name, its unique claim name)`` (exactly one claimer
  wins; the others see "not there"), opens the claim name and unlinks it at once, so no
  name stays behind. It maps the segment, marks it CLAIMED (+ its pid) and decodes in
  place. When the last tensor viewing the mapping is freed, a finalizer writes FREE and
  the sender reuses the segment.
* The sender reaps a published segment after its TTL by unlinking the key name (whoever
  unlinks/renames the key name first owns the segment). A receiver that still waits for
  the payload renews it (:func:`renew`): it writes the end of a lease (wall-clock ns; one
  host, one clock, in every PID namespace) into the header, and from then on that end,
  not the TTL, decides. A segment CLAIMED whose claim lock
  nobody holds (its receiver died) is taken back. ``close()`` unlinks every name the
  connector owns.
* A crashed process leaves pool names and published key names whose owner lock nobody
  holds, or a claim name; :func:`reap_stale` removes those (claim names once older than
  :data:`CLAIM_NAME_GRACE_S`).
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import re
import secrets
import struct
import time
from dataclasses import dataclass

from vllm_kvbridge.errors import ConfigError, TransferCorrupt

SHM_DIR = "/dev/shm"
PREFIX = "kvbridge"
HEADER_SIZE = 4096
MAGIC = int.from_bytes(b"KVBSHM02", "little")  # 02: the lease word

# magic, state, payload_size, generation, owner_pid, claimer_pid, published_ns, key_len,
# lease_end_ns (0: never renewed)
_HDR = struct.Struct("<9Q")
_KEY_OFFSET = _HDR.size
MAX_KEY_BYTES = HEADER_SIZE - _KEY_OFFSET
_STATE_WORD = 1  # index of the state word when the header is viewed as uint64 words
_CLAIMER_WORD = 5
_LEASE_WORD = 8

FREE, WRITING, READY, CLAIMED, RETIRED = 0, 1, 2, 3, 4

#: A claim name exists for two syscalls of a live receiver; one older than this is a leftover.
CLAIM_NAME_GRACE_S = 30.0
_OWNER_BYTE, _CLAIM_BYTE = 0, 1
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid

_NAMESPACE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KEY = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_NAME = re.compile(
    r"kvbridge\.(?P<ns>[A-Za-z0-9_-]{1,64})\.(?:(?P<kind>[pc])\.(?P<pid>\d+)\.[0-9a-f]+|k\.(?P<key>[A-Za-z0-9_.-]+))"
)
_counter = itertools.count()


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
        raise ConfigError(f"shared-memory namespace {namespace!r} must match [A-Za-z0-9_-]{{1,64}}")
    return namespace


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ConfigError(f"transfer key {key!r} must match [A-Za-z0-9_.-]{{1,200}} (see connectors.keys)")
    return key


def key_path(namespace: str, key: str, shm_dir: str = SHM_DIR) -> str:
    return os.path.join(shm_dir, f"{PREFIX}.{namespace}.k.{key}")


_tag = secrets.token_hex(4)


def _new_tag() -> None:
    global _tag
    _tag = secrets.token_hex(4)


os.register_at_fork(after_in_child=_new_tag)


def _unique_path(namespace: str, kind: str, shm_dir: str) -> str:
    return os.path.join(shm_dir, f"{PREFIX}.{namespace}.{kind}.{os.getpid()}.{_tag}{next(_counter):x}")


def _set_lock(fd: int, byte: int, kind: int) -> None:
    """Take (``F_WRLCK``/``F_RDLCK``) or drop (``F_UNLCK``) an OFD lock on one byte."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, byte, 1, 0))


def _locked_elsewhere(fd: int, byte: int) -> bool:
    """Whether another open file description (any process, any namespace) locks ``byte``."""
    probe = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return _FLOCK.unpack(probe)[0] != fcntl.F_UNLCK


def claim_held(fd: int) -> bool:
    """Whether a live receiver still holds a payload claimed from the segment ``fd``."""
    return _locked_elsewhere(fd, _CLAIM_BYTE)


def hold_claim(fd: int) -> None:
    _set_lock(fd, _CLAIM_BYTE, fcntl.F_RDLCK)


def release_claim(fd: int) -> None:
    _set_lock(fd, _CLAIM_BYTE, fcntl.F_UNLCK)


def _create_locked(path: str, shm_dir: str) -> int:
    """A new segment file under ``path`` whose owner lock is held before the name exists."""
    fd = _create_unnamed_locked(path, shm_dir)
    if fd is None:  # no O_TMPFILE or no /proc: lock right after creating (a tiny window)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        _set_lock(fd, _OWNER_BYTE, fcntl.F_WRLCK)
    return fd


def _create_unnamed_locked(path: str, shm_dir: str) -> int | None:
    try:
        fd = os.open(shm_dir, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):
        return None
    try:
        _set_lock(fd, _OWNER_BYTE, fcntl.F_WRLCK)
        # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names the unnamed file; os.link only
        # passes that flag when given a dir fd (plain link() would fail with EXDEV).
        proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.link(str(fd), path, src_dir_fd=proc_fds, follow_symlinks=True)
        finally:
            os.close(proc_fds)
    except FileExistsError:
        os.close(fd)
        raise
    except OSError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class Header:
    magic: int
    state: int
    payload_size: int
    generation: int
    owner_pid: int
    claimer_pid: int
    published_ns: int
    lease_end_ns: int
    key: str


def parse_header(raw: bytes) -> Header:
    """Validate and decode a header; raises :class:`TransferCorrupt` naming the problem."""
    if len(raw) < _HDR.size:
        raise TransferCorrupt(f"shared-memory segment too short for a header ({len(raw)} bytes)")
    magic, state, size, gen, owner, claimer, published, key_len, lease_end = _HDR.unpack_from(raw, 0)
    if magic != MAGIC:
        raise TransferCorrupt(f"shared-memory segment has bad magic {magic:#018x}")
    if state > RETIRED:
        raise TransferCorrupt(f"shared-memory segment has unknown state {state}")
    if key_len > MAX_KEY_BYTES or _KEY_OFFSET + key_len > len(raw):
        raise TransferCorrupt(f"shared-memory segment key length {key_len} out of range")
    try:
        key = raw[_KEY_OFFSET : _KEY_OFFSET + key_len].decode("ascii")
    except UnicodeDecodeError:
        raise TransferCorrupt("shared-memory segment key is not ASCII") from None
    return Header(magic, state, size, gen, owner, claimer, published, lease_end, key)


class PoolSegment:
    """A sender-owned segment: a pool name, a persistent pre-faulted read/write mapping."""

    def __init__(self, namespace: str, capacity: int, shm_dir: str = SHM_DIR) -> None:
        self.namespace = namespace
        self.capacity = capacity  # payload bytes, excluding the header
        self.path = _unique_path(namespace, "p", shm_dir)
        self.generation = 0
        self.key: str | None = None
        self.published_at = 0.0  # monotonic
        self.lent_at = 0.0  # monotonic: when a receiver took its key name
        size = HEADER_SIZE + capacity
        # Kept open for the segment's life: it holds the owner lock (see "Liveness").
        self.fd = _create_locked(self.path, shm_dir)
        try:
            # fallocate reserves the pages now: writing into a sparse tmpfs file that cannot
            # grow kills the process with SIGBUS, while this raises ENOSPC cleanly.
            os.posix_fallocate(self.fd, 0, size)
            self.mm = mmap.mmap(
                self.fd,
                size,
                flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except BaseException:
            os.unlink(self.path)
            os.close(self.fd)
            raise
        self._words = memoryview(self.mm)[: _HDR.size].cast("Q")
        self.payload = memoryview(self.mm)[HEADER_SIZE:]

    @property
    def state(self) -> int:
        return self._words[_STATE_WORD]

    @state.setter
    def state(self, value: int) -> None:
        # One aligned 8-byte store: readers never see a torn state word.
        self._words[_STATE_WORD] = value

    @property
    def claimer_pid(self) -> int:
        """The claimer's pid as it saw it (informational: meaningless across namespaces)."""
        return self._words[_CLAIMER_WORD]

    def claim_held(self) -> bool:
        return claim_held(self.fd)

    @property
    def lease_end_ns(self) -> int:
        """Wall-clock ns a receiver's renewal keeps this payload until; 0: never renewed."""
        return self._words[_LEASE_WORD]

    def begin_write(self) -> None:
        self.generation += 1
        self.state = WRITING

    def publish_header(self, key: str, payload_size: int) -> None:
        """Write every header field, the state word READY last."""
        raw = key.encode("ascii")
        self.mm[_KEY_OFFSET : _KEY_OFFSET + len(raw)] = raw
        _HDR.pack_into(
            self.mm,
            0,
            MAGIC,
            WRITING,
            payload_size,
            self.generation,
            os.getpid(),
            0,
            time.time_ns(),
            len(raw),
            0,
        )
        self.state = READY

    def destroy(self) -> None:
        """Unlink the pool name and unmap (a receiver still mapping it keeps the memory)."""
        # A published or claimed payload stays valid for its reader; only mark idle ones.
        if self.state in (FREE, WRITING):
            self.state = RETIRED
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)  # drops the owner lock: nothing of ours is in use any more
        self._words.release()
        self.payload.release()
        try:
            self.mm.close()
        except BufferError:  # an Encoded still references it; GC unmaps later
            pass


class ReceiverMapping:
    """A receiver's read/write mapping of a claimed segment (the whole file).

    Kept by the receiver across gets while the sender keeps the segment in its pool: a
    pool segment comes back with the same pages every time it is reused, so mapping it
    once (``MAP_POPULATE``: page tables filled up front) saves an mmap, a populate and an
    munmap per get (~40 ms per GiB here). ``busy`` is True while a payload decoded from
    it is alive. ``detached`` mappings are not (or no longer) cached: they are unmapped
    as soon as nothing views them. Its own file description holds the claim lock while a
    payload is alive (:meth:`hold_claim`), and shows (fstat) when the sender unlinks it.
    """

    def __init__(self, fd: int, size: int, *, detached: bool) -> None:
        self.size = size
        self.busy = False
        self.detached = detached
        self.last_used = time.monotonic()
        self.mm = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.fd = os.dup(fd)

    def hold_claim(self) -> None:
        """Before marking the segment CLAIMED: tells its sender (in any namespace) we live."""
        hold_claim(self.fd)

    def release(self) -> None:
        """After marking it FREE: drop the claim lock; a detached mapping goes away."""
        try:
            release_claim(self.fd)
        except OSError:  # already closed
            pass
        self.busy = False
        if self.detached:
            self._close_fd()
            try:
                self.mm.close()
            except BufferError:  # the view is still being torn down; GC unmaps
                pass

    def _close_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def orphaned(self) -> bool:
        """True once the sender dropped the segment (no name links to it, or it is RETIRED)."""
        try:
            return os.fstat(self.fd).st_nlink == 0 or read_generation(self.mm)[0] == RETIRED
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        """Forget the mapping: unmap now if nothing views it, else when the last view goes
        (its fd, and so the claim lock, stays until then)."""
        self.detached = True
        if not self.busy:
            self._close_fd()
            try:
                self.mm.close()
            except BufferError:  # a view is still being torn down; GC unmaps
                pass


def claim(namespace: str, key: str, shm_dir: str = SHM_DIR) -> int | None:
    """Atomically take the published segment ``key``; its fd, or ``None`` if not there.

    The key name is renamed to a name only this call knows, then unlinked, so exactly one
    claimer wins and nothing named stays in /dev/shm.
    """
    tmp = _unique_path(namespace, "c", shm_dir)
    try:
        os.rename(key_path(namespace, key, shm_dir), tmp)
    except FileNotFoundError:
        return None
    try:
        return os.open(tmp, os.O_RDWR | os.O_CLOEXEC)
    finally:
        os.unlink(tmp)


def open_shared(namespace: str, key: str, shm_dir: str = SHM_DIR) -> int | None:
    """Open the published segment ``key`` without claiming it (non-destructive reads)."""
    try:
        return os.open(key_path(namespace, key, shm_dir), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


def renew(namespace: str, key: str, lease_s: float, shm_dir: str = SHM_DIR) -> bool:
    """Keep the published, unclaimed segment ``key`` for ``lease_s`` from now (see the
    module docstring); False when no such payload is published. Between the open and the
    store the sender may reap the key and reuse the segment for another payload, whose
    lease is then extended once: it is read or expires later, it is never lost."""
    try:
        fd = os.open(key_path(namespace, key, shm_dir), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        mm = mmap.mmap(fd, HEADER_SIZE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):  # shorter than a header: not a segment of ours
        os.close(fd)
        return False
    os.close(fd)
    try:
        header = parse_header(mm[:HEADER_SIZE])
        if header.state != READY or header.key != key:
            return False
        words = memoryview(mm)[: _HDR.size].cast("Q")
        try:  # one aligned 8-byte store: the sender's sweep never reads a torn value
            words[_LEASE_WORD] = time.time_ns() + int(lease_s * 1e9)
        finally:
            words.release()
        return True
    finally:
        mm.close()


def set_state_word(mm: mmap.mmap, state: int, claimer_pid: int | None = None) -> None:
    words = memoryview(mm)[: _HDR.size].cast("Q")
    try:
        if claimer_pid is not None:
            words[_CLAIMER_WORD] = claimer_pid
        words[_STATE_WORD] = state
    finally:
        words.release()


def read_generation(mm: mmap.mmap) -> tuple[int, int]:
    """(state, generation) as the segment says now."""
    _, state, _, gen, *_ = _HDR.unpack_from(mm, 0)
    return state, gen


def list_names(namespace_prefix: str = "", *, shm_dir: str = SHM_DIR) -> list[str]:
    """Sorted names in ``shm_dir`` of namespaces starting with ``namespace_prefix``."""
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(f"{PREFIX}.{namespace_prefix}"))


def reap_stale(
    namespace: str | None = None,
    older_than: float = 0.0,
    *,
    shm_dir: str = SHM_DIR,
    claim_grace_s: float = CLAIM_NAME_GRACE_S,
) -> list[str]:
    """Remove ``kvbridge.*`` leftovers of processes that are gone; returns the names removed.

    A pool name, or a published key at least ``older_than`` seconds old, is removed when
    nobody holds its owner lock (or, for a key, its header is unreadable); a claim name
    once it is ``claim_grace_s`` (:data:`CLAIM_NAME_GRACE_S`) old. Segments of live processes, in any PID
    namespace, are left to their owner's TTL reaper. ``namespace=None`` scans every
    namespace.
    """
    removed = []
    now = time.time()
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or (namespace is not None and match["ns"] != namespace):
            continue
        path = os.path.join(shm_dir, name)
        if _is_stale(path, match["kind"], now, older_than, claim_grace_s):
            try:
                os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _is_stale(path: str, kind: str | None, now: float, older_than: float, claim_grace_s: float) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (FileNotFoundError, PermissionError):  # gone, or another user's: not ours to judge
        return False
    try:
        age = now - os.fstat(fd).st_ctime
        if kind == "c":
            return age >= claim_grace_s
        if kind is None:  # a published key
            if age < older_than:
                return False
            try:
                parse_header(os.pread(fd, HEADER_SIZE, 0))
            except TransferCorrupt:
                return True
        return not _locked_elsewhere(fd, _OWNER_BYTE)
    finally:
        os.close(fd)
