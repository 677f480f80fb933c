"""Same-host transport through POSIX shared memory (``/dev/shm``).

One copy on the sender (the packed payload written straight into a segment), zero on the
receiver (tensors are views of the mapped segment). The segment protocol, naming and
crash recovery are described in :mod:`vllm_kvbridge.connectors.shm_segments`.

Why a pool: a fresh tmpfs segment moves ~1.3 GB/s on this class of machine (every 4 KiB
page is allocated and zeroed on first touch) against ~11 GB/s for memcpy. The sender
therefore keeps the segments it created, mapped and pre-faulted, and reuses one as soon
as the receiver has released it (the receiver marks it FREE when the last tensor viewing
it is freed). A receiver maps a segment it claims with ``MAP_POPULATE`` (page tables
filled up front, ~25 GB/s here) and keeps that mapping while the sender keeps the
segment in its pool, so the next payload in the same segment costs no mmap, populate or
munmap (together ~40 ms per GiB). The receiver drops a kept mapping once the sender has
unlinked the segment (checked at the next claim of a new segment and by the reaper,
at most ``reap_interval_s`` later), so it never pins memory the sender gave up for long.

Config keys (all optional):

* ``namespace``: per-edge namespace in segment names (default: the edge name
  ``"<from>-<to>"``, escaped by ``keys.edge_name``).
* ``ttl_s`` (default 300): unclaimed published segments are reaped after this long,
  unless a receiver renews them (:meth:`SharedMemoryConnector.renew`).
* ``lease_s`` (default ``DEFAULT_LEASE_S``): how long one renewal keeps a segment.
* ``destructive`` (default True): a get claims the segment (read once, zero copy).
  With False, gets copy the payload out and leave it for other readers (the sender's
  TTL or ``cleanup`` removes it).
* ``pool_keep_bytes`` (default 2 GiB): free pool memory kept for reuse; beyond it freed
  segments are destroyed.
* ``max_payload_bytes`` (default 64 GiB): larger puts are refused, larger segments rejected.
* ``max_held_bytes`` (default 8 GiB): segment bytes this sender holds unread or being read
  at once; a put over it (or one that finds /dev/shm full) is refused with
  ``PutResult.full``, and the sender waits for room.
* ``reap_interval_s`` (default ``min(ttl_s/4, 1)``): how often the background reaper runs.
* ``claim_grace_s`` (default 30): a segment still READY this long after a receiver took its
  key name belonged to a receiver that died claiming it: the sender takes it back.
* ``map_cache_bytes`` (default 4 GiB): receiver side, the most segment bytes kept mapped
  between gets (0: map and unmap per get).
* ``shm_dir`` (default ``/dev/shm``): for tests on another tmpfs.

Threading: every public method is safe to call from several threads.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_kvbridge.connectors import shm_segments as seg
from vllm_kvbridge.connectors.base import (
    DEFAULT_LEASE_S,
    Connector,
    Due,
    LentReservation,
    Meta,
    PutResult,
    Stage,
    number_option,
)
from vllm_kvbridge.connectors.dir_watch import ArrivalWait, WatchPool
from vllm_kvbridge.connectors.keys import edge_name
from vllm_kvbridge.connectors.shm_maps import MapCache
from vllm_kvbridge.errors import PayloadError, TransferCorrupt, TransferTimeout

_MISSING = object()
_MIN_CAPACITY = 64 << 10


def _capacity_for(nbytes: int) -> int:
    """Round up to a size class (<= 12.5% waste) so segments are reusable across sizes."""
    nbytes = max(nbytes, _MIN_CAPACITY)
    granule = max(_MIN_CAPACITY, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // granule) * granule


def _release_claimed(mapping: seg.ReceiverMapping, generation: int) -> None:
    """Finalizer of a claimed payload: hand the segment back to the sender's pool.

    Runs in whichever thread frees the last view, so it takes no lock: it writes the
    state word, then drops the claim lock and clears ``busy``; a detached mapping is
    unmapped here, a cached one stays mapped for the next get.
    """
    try:
        state, gen = seg.read_generation(mapping.mm)
        if state == seg.CLAIMED and gen == generation:
            seg.set_state_word(mapping.mm, seg.FREE, claimer_pid=0)
    except ValueError:  # mapping already closed
        return
    mapping.release()


@dataclass
class _Lent:
    """A pool segment lent to a reservation, and the bytes it counts as held."""

    namespace: str
    segment: seg.PoolSegment
    reserved: int


class SharedMemoryConnector(Connector):
    """Moves payloads between processes of one host through ``/dev/shm`` segments."""

    name = "SharedMemoryConnector"
    data_outlives_sender = True  # the segment stays in /dev/shm after its sender exits

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self._namespace_override = (
            seg.check_namespace(cfg["namespace"]) if cfg.get("namespace") is not None else None
        )
        self.ttl_s = number_option(cfg, "ttl_s", 300.0)
        self.lease_s = number_option(cfg, "lease_s", DEFAULT_LEASE_S)
        self.destructive = bool(cfg.get("destructive", True))
        self.pool_keep_bytes = number_option(cfg, "pool_keep_bytes", 2 << 30, int)
        self.max_payload_bytes = number_option(cfg, "max_payload_bytes", 64 << 30, int)
        self.max_held_bytes = number_option(cfg, "max_held_bytes", 8 << 30, int)
        self._reserved = 0  # segment bytes of puts under way (counted against max_held_bytes)
        #: segments lent to reservations not published or released yet (named until then)
        self._writing: set[seg.PoolSegment] = set()
        self.reap_interval_s = number_option(cfg, "reap_interval_s", min(self.ttl_s / 4, 1.0)) or 0.05
        self.claim_grace_s = number_option(cfg, "claim_grace_s", seg.CLAIM_NAME_GRACE_S)
        self.map_cache_bytes = number_option(cfg, "map_cache_bytes", 4 << 30, int)
        self.shm_dir = str(cfg.get("shm_dir", seg.SHM_DIR))
        self._watches = WatchPool(self.shm_dir)  # waiting gets sleep on these
        self._limits = cfg.get("limits")
        self._lock = threading.Lock()
        self._free: list[seg.PoolSegment] = []  # mapped, state FREE, ready for reuse
        self._published: dict[tuple[str, str], seg.PoolSegment] = {}  # key name exists
        self._lent: list[seg.PoolSegment] = []  # claimed by a receiver, waiting for FREE
        self._namespaces: set[str] = set()
        self._maps = MapCache(self.map_cache_bytes)  # receiver: mappings kept between gets
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        self._expired = 0  # published payloads reaped unread (TTL or lease)
        #: Told each key reaped unread (under this connector's lock: it must not block).
        self.on_expired: Callable[[str], None] | None = None

    # -- naming -------------------------------------------------------------------------
    def namespace(self, from_stage: Stage, to_stage: Stage) -> str:
        """The segment namespace of an edge (config ``namespace`` or :func:`edge_name`)."""
        if self._namespace_override is not None:
            return self._namespace_override
        name = edge_name(from_stage, to_stage)
        if len(name) > 64:  # long stage names: a stable hash, which has no "-" and so never
            name = "h" + hashlib.sha256(name.encode()).hexdigest()[:32]  # meets a readable one
        return seg.check_namespace(name)

    @classmethod
    def reap_dead(cls, config: Mapping[str, Any], from_stage: Stage, to_stage: Stage) -> list[str]:
        """Unlink the edge's pool, claim and published names whose owner process is gone."""
        conn = cls(config)  # no threads, no segments until first used: naming only
        try:
            return seg.reap_stale(conn.namespace(from_stage, to_stage), shm_dir=conn.shm_dir)
        finally:
            conn.close()

    def _use_namespace(self, namespace: str) -> None:
        if namespace not in self._namespaces:
            self._namespaces.add(namespace)
            seg.reap_stale(namespace, shm_dir=self.shm_dir)  # leftovers of crashed processes

    # -- sender -------------------------------------------------------------------------
    def put(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        """Write ``payload`` into a pool segment and publish it as ``key``.

        Returns ``ok=False`` (never raises) when the key is already published, the payload
        is larger than ``max_payload_bytes`` or /dev/shm is full. The payload is copied:
        the caller may reuse its tensors once this returns.
        """
        self._check_open()
        seg.check_key(key)
        return self._put_reserved(from_stage, to_stage, key, payload)

    def reserve(self, from_stage: Stage, to_stage: Stage, key: str, nbytes: int) -> Any:
        """A pool segment to write a packed payload of ``nbytes`` into (one copy from the
        sender's data to where the receiver maps it); ``full`` when the held bytes or
        /dev/shm leave no room now. See :class:`~vllm_kvbridge.connectors.base.Reservation`."""
        self._check_open()
        seg.check_key(key)
        namespace = self.namespace(from_stage, to_stage)
        if (refused := self._refuse_oversize(nbytes)) is not None:
            return refused
        with self._lock:
            self._check_open()
            self._use_namespace(namespace)
            self._sweep_locked()
            size = _capacity_for(nbytes)  # what a new segment for it takes in /dev/shm
            if size > self.max_held_bytes:  # would never fit: waiting cannot help
                return self._put_failed(f"a {size}-byte segment exceeds max_held_bytes={self.max_held_bytes}")
            held = self._held_bytes_locked()
            if held + size > self.max_held_bytes:
                return self._put_full(
                    f"{held} segment bytes held + {size} exceeds max_held_bytes={self.max_held_bytes}"
                )
            segment = self._take_free_locked(namespace, nbytes)
            reserved = segment.capacity if segment is not None else size
            self._reserved += reserved
        if segment is None:
            try:
                segment = seg.PoolSegment(namespace, _capacity_for(nbytes), self.shm_dir)
            except OSError as exc:
                with self._lock:
                    self._reserved -= reserved
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):  # room comes back as receivers read
                    return self._put_full(f"/dev/shm has no room for a {nbytes}-byte segment: {exc}")
                return self._put_failed(f"cannot create a {nbytes}-byte shared-memory segment: {exc}")
        segment.begin_write()
        with self._lock:
            if self._closed:  # close() ran while the segment was made: it never saw it
                self._reserved -= reserved
                segment.destroy()
                self._check_open()
            self._writing.add(segment)
        return LentReservation(
            self, key, nbytes, segment.payload[:nbytes], _Lent(namespace, segment, reserved)
        )

    def _held_bytes_locked(self) -> int:
        """Segment bytes out of the pool: published, being read, or reserved for writing."""
        out = sum(s.capacity for s in self._published.values()) + sum(s.capacity for s in self._lent)
        return out + self._reserved

    def _publish_lent(self, r: LentReservation, start: float) -> PutResult:
        """Publish the written segment of ``r`` under its key (see :meth:`reserve`)."""
        lent: _Lent = r.lent
        namespace, key, segment = lent.namespace, r.key, lent.segment
        try:
            segment.publish_header(key, r.nbytes)
            os.link(segment.path, seg.key_path(namespace, key, self.shm_dir))
        except FileExistsError:
            return self._put_failed(f"key {key!r} is already published in namespace {namespace!r}")
        with self._lock:
            if self._closed:  # close() ran meanwhile: do not leave the key behind
                self._unpublish(namespace, key)
                return self._put_failed(f"{self.name} closed during put")
            self._reserved -= lent.reserved
            self._writing.discard(segment)
            segment.key = key
            segment.published_at = time.monotonic()
            self._published[(namespace, key)] = segment
            self._start_reaper_locked()
        self.stats.add(puts=1, put_bytes=r.nbytes, put_seconds=time.perf_counter() - start)
        name = os.path.basename(seg.key_path(namespace, key, self.shm_dir))
        return PutResult(
            ok=True, nbytes=r.nbytes, metadata={"namespace": namespace, "name": name, "lease_s": self.lease_s}
        )

    def _release_lent(self, r: LentReservation) -> None:
        """An unpublished reservation ends: its segment goes back to the pool."""
        with self._lock:
            self._reserved -= r.lent.reserved
            self._writing.discard(r.lent.segment)
        self._return_free(r.lent.segment)

    def _take_free_locked(self, namespace: str, need: int) -> seg.PoolSegment | None:
        best = None
        biggest = 2 * max(need, _MIN_CAPACITY)  # do not pin a huge segment for a small payload
        for candidate in self._free:
            if (
                candidate.namespace == namespace
                and need <= candidate.capacity <= biggest
                and (best is None or candidate.capacity < best.capacity)
            ):
                best = candidate
        if best is not None:
            self._free.remove(best)
        return best

    def _return_free(self, segment: seg.PoolSegment) -> None:
        segment.key = None
        with self._lock:
            if self._closed:
                segment.destroy()
                return
            segment.state = seg.FREE
            self._free.append(segment)
            self._trim_locked()

    def _trim_locked(self) -> None:
        kept = sum(s.capacity for s in self._free)
        while kept > self.pool_keep_bytes and self._free:
            victim = max(self._free, key=lambda s: s.capacity)
            self._free.remove(victim)
            kept -= victim.capacity
            victim.destroy()

    def _unpublish(self, namespace: str, key: str) -> bool:
        """Unlink the key name; True when we removed it (nobody claimed it first)."""
        try:
            os.unlink(seg.key_path(namespace, key, self.shm_dir))
            return True
        except FileNotFoundError:
            return False

    def _sweep_locked(self) -> None:
        """TTL-reap unclaimed segments; take back segments receivers released (or died holding)."""
        now, wall_ns = time.monotonic(), time.time_ns()
        for (namespace, key), segment in list(self._published.items()):
            state = segment.state
            lease_end = segment.lease_end_ns
            if state == seg.READY and (
                wall_ns < lease_end if lease_end else now - segment.published_at < self.ttl_s
            ):
                continue
            del self._published[(namespace, key)]
            if state == seg.READY and self._unpublish(namespace, key):
                self._expired += 1
                if self.on_expired is not None:
                    self.on_expired(key)
                segment.state = seg.FREE
                self._free.append(segment)
            else:
                self._lend_locked(segment)
        died_claiming: set[str] = set()
        for segment in list(self._lent):
            state = segment.state
            # READY long after its key name went: the receiver died between its rename and
            # its open (a claim takes two syscalls); nobody can reach the segment any more.
            stuck = state == seg.READY and now - segment.lent_at >= self.claim_grace_s
            if stuck:
                died_claiming.add(segment.namespace)
            if stuck or state == seg.FREE or (state == seg.CLAIMED and not segment.claim_held()):
                self._lent.remove(segment)
                segment.state = seg.FREE
                segment.key = None
                self._free.append(segment)
        for namespace in died_claiming:  # and its claim name, a link to the segment
            seg.reap_stale(namespace, claim_grace_s=self.claim_grace_s, shm_dir=self.shm_dir)
        self._trim_locked()

    def _lend_locked(self, segment: seg.PoolSegment) -> None:
        """A segment whose key name someone else took: it comes back when released."""
        segment.lent_at = time.monotonic()
        self._lent.append(segment)

    def _start_reaper_locked(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap_loop, name="kvbridge-shm-reaper", daemon=True)
            self._reaper.start()

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.reap_interval_s):
            with self._lock:
                if self._closed:
                    return
                self._sweep_locked()
                self._maps.sweep()

    # -- receiver -----------------------------------------------------------------------
    def _namespace_of(self, from_stage: Stage, to_stage: Stage, metadata: Mapping[str, Any] | None) -> str:
        if metadata and metadata.get("namespace") is not None:
            return seg.check_namespace(metadata["namespace"])
        return self.namespace(from_stage, to_stage)

    def renew(self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None) -> bool:
        """Keep the published segment ``key`` for the sender's ``lease_s`` (from ``metadata``)."""
        self._check_open()
        seg.check_key(key)
        lease_s = float((metadata or {}).get("lease_s", DEFAULT_LEASE_S))
        return seg.renew(self._namespace_of(from_stage, to_stage, metadata), key, lease_s, self.shm_dir)

    def get(
        self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None, *, deadline: Due = None
    ) -> Any | None:
        """Claim and decode the segment published as ``key``.

        Waits until ``deadline``, then raises :class:`TransferTimeout`; without a deadline
        one attempt, ``None`` if absent. The wait sleeps on an inotify watch of the segment
        directory (:class:`~vllm_kvbridge.connectors.dir_watch.ArrivalWait`), woken when
        the key's name is linked; where inotify is not available it polls (every 50 us at
        first, backing off to 1 ms).
        A malformed segment raises :class:`TransferCorrupt` (and is removed).
        Destructive gets return tensors that are views of the segment: it goes back to
        the sender's pool when the last of them is freed.
        """
        self._check_open()
        seg.check_key(key)
        namespace = self._namespace_of(from_stage, to_stage, metadata)
        start = time.perf_counter()
        arrival = ArrivalWait(self._watches, os.path.basename(seg.key_path(namespace, key, self.shm_dir)))
        try:
            while True:
                try:
                    result = self._try_get(namespace, key)
                except TransferCorrupt:
                    self.stats.add(get_failures=1)
                    raise
                if result is not _MISSING:
                    payload, nbytes = result
                    self.stats.add(gets=1, get_bytes=nbytes, get_seconds=time.perf_counter() - start)
                    return payload
                left = self.remaining(deadline)
                if left is None:
                    self.stats.add(get_misses=1)
                    return None
                if left <= 0:
                    self.stats.add(timeouts=1)
                    raise TransferTimeout(
                        f"{key!r} did not arrive in shared-memory namespace {namespace!r} before the deadline"
                    )
                arrival.sleep(left)
                self._check_open()
        finally:
            arrival.close()

    def _try_get(self, namespace: str, key: str) -> Any:
        if self.destructive:
            fd = seg.claim(namespace, key, self.shm_dir)
        else:
            fd = seg.open_shared(namespace, key, self.shm_dir)
        if fd is None:
            return _MISSING
        try:
            header = seg.parse_header(os.pread(fd, seg.HEADER_SIZE, 0))
            st = os.fstat(fd)
            file_size = st.st_size
            if header.key != key:
                raise TransferCorrupt(f"segment published as {key!r} carries key {header.key!r}")
            if header.state != seg.READY:
                raise TransferCorrupt(f"segment {key!r} published in state {header.state}, not READY")
            if header.payload_size > min(file_size - seg.HEADER_SIZE, self.max_payload_bytes):
                raise TransferCorrupt(
                    f"segment {key!r} claims {header.payload_size} payload bytes; file has "
                    f"{file_size} (max_payload_bytes={self.max_payload_bytes})"
                )
            length = seg.HEADER_SIZE + header.payload_size
            if self.destructive:
                mapping = self._claimed_mapping(fd, st, length)
            else:
                mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if self.destructive:
            return self._decode_claimed(mapping, header, key)
        return self._decode_shared(mm, header, key)

    def _claimed_mapping(self, fd: int, st: os.stat_result, length: int) -> seg.ReceiverMapping:
        """A mapping of the claimed segment ``fd``: a kept one (:class:`MapCache`), or one
        of just this payload, unmapped when released."""
        with self._lock:
            self._check_open()
            mapping, kept = self._maps.take(fd, st, self.max_payload_bytes)
            if kept:
                self._start_reaper_locked()
        if mapping is None:
            mapping = seg.ReceiverMapping(fd, length, detached=True)
            mapping.busy = True
        return mapping

    def _decode_claimed(self, mapping: seg.ReceiverMapping, header: seg.Header, key: str) -> Any:
        from vllm_kvbridge.wire import decode_packed

        mm = mapping.mm
        mapping.hold_claim()  # before CLAIMED: the sender never sees CLAIMED unlocked
        seg.set_state_word(mm, seg.CLAIMED, claimer_pid=os.getpid())
        view = np.frombuffer(mm, dtype=np.uint8, count=header.payload_size, offset=seg.HEADER_SIZE)
        # The payload's tensors view `view`; when the last goes, the segment goes home.
        weakref.finalize(view, _release_claimed, mapping, header.generation)
        try:
            payload = decode_packed(view, limits=self._limits, copy=False)
        except PayloadError as exc:
            raise TransferCorrupt(f"segment {key!r} does not decode: {exc}") from exc
        finally:
            del view
        return payload, header.payload_size

    def _decode_shared(self, mm: mmap.mmap, header: seg.Header, key: str) -> Any:
        from vllm_kvbridge.wire import decode_packed

        try:
            view = np.frombuffer(mm, dtype=np.uint8, count=header.payload_size, offset=seg.HEADER_SIZE)
            try:
                payload = decode_packed(view, limits=self._limits, copy=True)
            except PayloadError as exc:
                raise TransferCorrupt(f"segment {key!r} does not decode: {exc}") from exc
            finally:
                del view
            # Seqlock check: the sender may have reaped and rewritten it while we copied.
            if seg.read_generation(mm) != (seg.READY, header.generation):
                return _MISSING
        finally:
            try:
                mm.close()
            except BufferError:
                pass
        return payload, header.payload_size

    # -- lifecycle ----------------------------------------------------------------------
    def cleanup(self, key: str) -> None:
        """Withdraw ``key`` if this side published it and nobody claimed it yet. Idempotent."""
        self.withdraw(key)

    def publishes(self, key: str) -> bool:
        """Whether this side holds ``key`` published and unclaimed (as of its last sweep)."""
        with self._lock:
            return any(published == key for _, published in self._published)

    def withdraw(self, key: str) -> bool:
        """:meth:`cleanup`, answering whether ``key`` was withdrawn unread: after True no
        receiver can have it (a claim and a withdrawal exclude each other)."""
        seg.check_key(key)
        withdrawn = False
        with self._lock:
            for (namespace, published_key), segment in list(self._published.items()):
                if published_key != key:
                    continue
                del self._published[(namespace, published_key)]
                if self._unpublish(namespace, key):
                    segment.state = seg.FREE
                    segment.key = None
                    self._free.append(segment)
                    withdrawn = True
                else:
                    self._lend_locked(segment)
                self.stats.add(cleanups=1)
            self._trim_locked()
        return withdrawn

    def health(self) -> dict[str, Any]:
        with self._lock:
            if not self._closed:
                self._sweep_locked()  # so the pool figures are current
            if not self._closed:
                self._maps.sweep()
            pool = {
                "pool_free_segments": len(self._free),
                "pool_free_bytes": sum(s.capacity for s in self._free),
                "published": len(self._published),
                "expired": self._expired,
                "lent": len(self._lent),
                "held_bytes": self._held_bytes_locked(),
                **self._maps.stats(),
            }
        return {**super().health(), **pool}

    def _close(self) -> None:
        self._stop.set()
        self._watches.close()
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5)
        with self._lock:
            for (namespace, key), _segment in self._published.items():
                self._unpublish(namespace, key)
            segments = [*self._published.values(), *self._lent, *self._free]
            self._published.clear()
            self._lent.clear()
            self._free.clear()
            for segment in segments:
                segment.destroy()
            # A reservation still out (a send the shutdown did not wait for): its name goes
            # now, its memory when it is released (then destroyed) or with the process.
            for segment in self._writing:
                try:
                    os.unlink(segment.path)
                except FileNotFoundError:
                    pass
            self._writing.clear()
            for namespace in self._namespaces:
                seg.reap_stale(namespace, shm_dir=self.shm_dir)
            # Payloads still viewed keep their mapping until released (then unmapped).
            self._maps.close()
