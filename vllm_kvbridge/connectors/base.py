"""The transport contract every connector implements.

A connector moves one *payload* (anything the wire codec encodes: a dict of tensors,
a :class:`~vllm_kvbridge.wire.KVCacheTransferData`, ...) from a sender stage to a
receiver stage under a *key* (see :mod:`vllm_kvbridge.connectors.keys`).

Roles:
  * the sender calls :meth:`Connector.put`; the returned :class:`PutResult.metadata`
    is what the receiver needs to find the data (an address, a segment name). The
    pipeline forwards it to the receiver as "sender info".
  * or, to write a payload once straight where the receiver reads it (the KV sender's
    one-copy path), the sender *reserves* a destination of the payload's packed size
    (:meth:`Connector.reserve`), *fills* it (:meth:`vllm_kvbridge.wire.Encoded.pack_into`,
    whose :class:`~vllm_kvbridge.wire.fill.TensorFill` sources gather straight into it)
    and *publishes* it (:meth:`Reservation.publish`, whose result is a put's). What is on
    the wire is the same as a put of the same payload.
  * the receiver calls :meth:`Connector.get` with the same key and that metadata.

Semantics every implementation keeps (the shared contract test suite checks them):
  * ``get`` returns the decoded payload, or ``None`` only for "not there yet" when no
    deadline was given. With a deadline it waits until the payload arrives or the
    deadline (``time.monotonic()`` seconds) passes, then raises :class:`TransferTimeout`.
    Corrupt data raises :class:`TransferCorrupt`; a refused operation
    :class:`TransferRefused`. A get is destructive by default: a key is read once.
  * ``put`` never reports ``ok=True`` for data the receiver cannot get.
  * ``cleanup(key)`` releases everything held for that key on this side; ``close()``
    releases everything and is idempotent. Both are safe to call twice.
  * ``health()`` returns a JSON-safe dict of counters; counters are thread-safe.
  * Lifetime of a payload nobody has read: its sender drops it ``ttl_s`` after the put,
    unless a receiver renews it. ``renew(key, metadata)`` (receiver side) moves the expiry
    to ``lease_s`` after the renewal (the sender's option; ``PutResult.metadata["lease_s"]``
    tells receivers). A live consumer that still waits for the data renews it every
    ``lease_s / 6`` and keeps it however long its queue is; a dead one's is freed about
    one lease after its last renewal. ``renew`` returns False when the sender does not
    hold the key (not yet, or no more) and raises :class:`TransferError` when the sender
    cannot be reached. ``health()["expired"]`` counts payloads dropped unread this way.
  * Backpressure: a sender that already holds its limit of unread bytes (``max_inflight_bytes``,
    ``max_held_bytes``, a full store or /dev/shm) refuses a put with ``PutResult.full``; the
    same put succeeds once receivers read or leases expire. Callers wait for room
    (:func:`vllm_kvbridge.connectors.put_retry.put_with_retry`), they never drop the payload.
    A reservation counts against the same limit from :meth:`Connector.reserve` until it
    is published or released; ``reserve`` never waits: it answers ``full`` at once.
"""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.connectors.held_table import HeldTable, Refusal
from vllm_kvbridge.connectors.registered_pool import RegisteredBufferPool
from vllm_kvbridge.errors import ConfigError, ConnectorClosed, TransferError

#: A stage of the pipeline: its index, or its name (``from_stage`` / ``to_stage``).
Stage = int | str
#: What the receiver knows of a put: its ``PutResult.metadata`` (None: nothing).
Meta = Mapping[str, Any] | None
#: A get's deadline, a ``time.monotonic()`` value (None: ask once).
Due = float | None


@dataclass(frozen=True)
class PutResult:
    """Outcome of a put: whether it landed, how many bytes moved, and the receiver's clues."""

    ok: bool
    nbytes: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    #: Refused only because the sender holds its limit of unread bytes now: the same put can
    #: succeed later (wait for room), unlike any other refusal.
    full: bool = False


class Reservation(ABC):
    """A destination of ``nbytes`` for one packed payload (see the module docstring).

    ``buffer`` is writable and at least ``nbytes`` long; the sender writes the packed
    payload into ``buffer[:nbytes]`` (on any one thread), then calls :meth:`publish`, or
    :meth:`release` to give the destination back unpublished. A publish that returned
    ``ok=False`` may be tried again (e.g. ``full``, a transient store error: the buffer
    still holds the data) until it succeeds or the sender releases. After a successful
    publish the connector owns the data (``release`` then does nothing); ``release`` is
    idempotent. Whoever reserved must publish or release: until then the bytes count as
    held by the connector.
    """

    def __init__(self, key: str, nbytes: int, buffer: memoryview) -> None:
        self.key, self.nbytes, self.buffer = key, nbytes, buffer

    @abstractmethod
    def publish(self) -> PutResult:
        """Make the packed payload in ``buffer[:nbytes]`` readable under ``key``."""

    @abstractmethod
    def release(self) -> None:
        """Give the destination back unpublished (no-op once published); idempotent."""


class HeapReservation(Reservation):
    """A reservation in a host buffer of this process.

    Any connector's, by default: published by a :meth:`put <Connector.put>` of the decoded
    payload (views of the buffer, no copy of its own), so the put's copy, if the connector
    makes one, is a second copy. A connector that serves from this process's memory (ZMQ)
    passes ``publish(reservation, since)`` to serve the buffer itself, and may pass the
    ``storage`` (a writable uint8 buffer of at least ``nbytes``, e.g. a pooled one that goes
    back to its pool when the last view of it dies; default: a new one). ``connector`` may be
    a function returning it (called at each publish: a sender whose transport is not up
    yet retries creating it). Senders also fall
    back to the default where a connector's own memory is full now (the put then waits for
    room, as any put does)."""

    def __init__(
        self,
        connector: Connector | Callable[[], Connector],
        from_stage: Stage,
        to_stage: Stage,
        key: str,
        nbytes: int,
        *,
        publish: Callable[[HeapReservation, float], PutResult] | None = None,
        storage: Any = None,
    ) -> None:
        if storage is None:
            import torch

            storage = torch.empty(nbytes, dtype=torch.uint8).numpy()  # uninitialised: no page touched
        self._storage: Any = storage
        super().__init__(key, nbytes, memoryview(storage))
        self._connector, self._stages = connector, (from_stage, to_stage)
        self._publish = publish or self._put_decoded
        self._created = time.perf_counter()

    def publish(self) -> PutResult:
        if self._storage is None:
            return PutResult(ok=False, error=f"reservation of {self.key!r} was published or released")
        result = self._publish(self, self._created)
        if result.ok:
            self.release()
        return result

    def _put_decoded(self, r: HeapReservation, start: float) -> PutResult:
        from vllm_kvbridge.wire import decode_packed

        conn = self._connector if isinstance(self._connector, Connector) else self._connector()
        return conn.put(*self._stages, self.key, decode_packed(self.buffer[: self.nbytes]))

    def release(self) -> None:
        # What was published keeps the memory alive through its own views of it.
        self._storage = None
        self.buffer = memoryview(b"")


class LentReservation(Reservation):
    """A reservation of memory a connector lends (a pool segment, a registered slab).

    ``lent`` is the connector's own record of what it lent. :meth:`publish` calls the
    owner's ``_publish_lent(reservation, since)`` (``since``: when the put began, for its
    stats) and ends the reservation when that succeeds; :meth:`release` calls
    ``_release_lent(reservation)`` once. Both are thread-safe and run the owner at most
    once after the reservation ended."""

    def __init__(self, owner: Any, key: str, nbytes: int, buffer: memoryview, lent: Any) -> None:
        super().__init__(key, nbytes, buffer)
        self.lent = lent
        self._owner = owner
        self._created = time.perf_counter()
        self._lock = threading.Lock()

    def publish(self, *, since: float | None = None) -> PutResult:
        with self._lock:
            owner = self._owner
            if owner is None:
                return PutResult(ok=False, error=f"reservation of {self.key!r} was published or released")
            result = owner._publish_lent(self, self._created if since is None else since)
            if result.ok:
                self._owner, self.buffer = None, memoryview(b"")
            return result

    def release(self) -> None:
        with self._lock:
            owner, self._owner = self._owner, None
            if owner is not None:
                self.buffer = memoryview(b"")
                owner._release_lent(self)


class ConnectorStats:
    """Thread-safe counters behind :meth:`Connector.health`."""

    _FIELDS = (
        "puts",
        "put_bytes",
        "put_failures",
        "gets",
        "get_bytes",
        "get_misses",
        "get_failures",
        "timeouts",
        "cleanups",
        "put_full",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {name: 0 for name in self._FIELDS}
        self._values["put_seconds"] = 0.0
        self._values["get_seconds"] = 0.0

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] = self._values.get(name, 0) + delta

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)


#: Default ``lease_s`` of every connector: how long one renewal keeps a payload nobody read.
DEFAULT_LEASE_S = 60.0
#: A receiver renews what it waits for this often, in leases (vLLM's NIXL connector: 1/6).
RENEW_FRACTION = 1 / 6

#: ``health()`` counters a stage adds up over its connectors and reports to the pipeline
#: (``serve``'s Prometheus series), by their name there. ``unreachable`` is a state, not a
#: count: 1 while a connector cannot reach the service its edge needs (a Mooncake store's
#: master); summed, how many of the stage's connectors are cut off (``/health`` degraded).
EDGE_COUNTERS = {"expired": "leases_expired", "put_full": "puts_full", "unreachable": "edges_unreachable"}


def edge_counters(healths: Iterable[Mapping[str, Any] | None]) -> dict[str, float]:
    """:data:`EDGE_COUNTERS` summed over connectors' ``health()`` dicts (None: no connector)."""
    out = dict.fromkeys(EDGE_COUNTERS.values(), 0.0)
    for health in healths:
        for name, counter in EDGE_COUNTERS.items():
            out[counter] += float((health or {}).get(name) or 0)
    return out


#: Longest transfer key the in-memory connectors accept (store/file keys have their own rules).
MAX_KEY = 512


def number_option(config: Mapping[str, Any], name: str, default: float, kind: type = float) -> Any:
    """The non-negative number ``config[name]`` (else ``default``) as ``kind``; ConfigError naming it."""
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"connector option {name!r} must be a non-negative number, got {value!r}")
    return kind(value)


def choice_option(
    config: Mapping[str, Any], name: str, choices: tuple[str, ...], *, lower: bool = True
) -> str:
    """``config[name]`` (else ``choices[0]``, the default; lowercased unless ``lower`` is
    False), one of ``choices``; ConfigError naming the option and its choices."""
    value = str(config.get(name, choices[0]))
    value = value.lower() if lower else value
    if value not in choices:
        allowed = " or ".join(", ".join(repr(c) for c in choices).rsplit(", ", 1))
        raise ConfigError(f"connector option {name!r} must be {allowed}, got {value!r}")
    return value


_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "KI": 1 << 10,
    "MI": 1 << 20,
    "GI": 1 << 30,
    "TI": 1 << 40,
}


def parse_size(value: Any, name: str) -> int:
    """Bytes from an int or a string such as ``"512MiB"`` / ``"1GB"`` / ``"4096"``."""
    if isinstance(value, bool):
        raise ConfigError(f"connector option {name!r} must be a size, got {value!r}")
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        if match:
            unit = (match.group(2) or "").upper().rstrip("B")
            return int(match.group(1)) * _UNITS[unit]
    raise ConfigError(
        f"connector option {name!r} must be a non-negative size (bytes or e.g. '1GiB'), got {value!r}"
    )


def offset_port(config: Mapping[str, Any], key: str, rank: int) -> dict[str, Any]:
    """``config`` with a fixed (non-zero) ``config[key]`` port moved up by ``rank``."""
    out = dict(config)
    if out.get(key):
        out[key] = int(out[key]) + rank
    return out


class Connector(ABC):
    """Base class of every transport. Subclasses implement the ``_``-free abstract methods."""

    #: Registry name, set by subclasses (e.g. ``"SharedMemoryConnector"``).
    name: str = "Connector"
    #: Largest payload a put accepts (subclasses set it from their config; see _refuse_oversize).
    max_payload_bytes: int = 64 << 30
    #: Whether a payload nobody has read yet can still be read once its sender's process is
    #: gone (shared memory, a store: True) or died with it (served from the sender's own
    #: memory: ZMQ, transfer engine, NIXL: False). When a producer stage is lost, its
    #: consumers fail at once the requests whose data it held and they had not read, instead
    #: of waiting for ``recv_timeout`` (``pipeline/supervision.py``). True, the default for a
    #: connector that does not say, keeps such requests waiting: never wrongly failed.
    data_outlives_sender: bool = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config: dict[str, Any] = dict(config or {})
        self.stats = ConnectorStats()
        self._closed = False
        self._close_lock = threading.Lock()

    # -- the contract -------------------------------------------------------------------
    @abstractmethod
    def put(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        """Make ``payload`` available to ``to_stage`` under ``key``."""

    @abstractmethod
    def get(
        self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None, *, deadline: Due = None
    ) -> Any | None:
        """Return the payload stored under ``key`` (see the module docstring for semantics)."""

    def reserve(self, from_stage: Stage, to_stage: Stage, key: str, nbytes: int) -> Reservation | PutResult:
        """Sender side: a destination for a packed payload of ``nbytes`` to publish under
        ``key`` (see :class:`Reservation`), or, when none can be had now, the refused
        put's :class:`PutResult` (``full``: room comes back as receivers read; never waits).

        This default, for a connector without memory of its own to lend, is a
        :class:`HeapReservation` (published by a put)."""
        self._check_open()
        self._check_key(key)
        return HeapReservation(self, from_stage, to_stage, key, nbytes)

    def _put_reserved(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        """A put as reserve + pack + publish, for a connector whose :meth:`reserve` lends its
        own memory (a :class:`LentReservation`): one implementation of both paths. A refused
        put holds nothing afterwards."""
        from vllm_kvbridge.wire import encode

        start = time.perf_counter()
        enc = encode(payload)
        reservation = self.reserve(from_stage, to_stage, key, enc.packed_size())
        if isinstance(reservation, PutResult):
            return reservation
        try:
            enc.pack_into(reservation.buffer)
            return reservation.publish(since=start)
        finally:
            del enc
            reservation.release()  # a no-op once published

    def renew(self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None) -> bool:
        """Receiver side: ask the sender to keep ``key`` for its ``lease_s`` from now (see the
        module docstring). False: the sender does not hold it. This default is for a
        connector without leases (its payloads live ``ttl_s``): it renews nothing."""
        return False

    @abstractmethod
    def cleanup(self, key: str) -> None:
        """Release whatever this side still holds for ``key``. Idempotent."""

    def health(self) -> dict[str, Any]:
        """JSON-safe status and counters."""
        return {"connector": self.name, "closed": self._closed, **self.stats.snapshot()}

    def close(self) -> None:
        """Release every resource. Idempotent; later calls to put/get raise ConnectorClosed."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    @abstractmethod
    def _close(self) -> None:
        """Release resources; called once by :meth:`close`."""

    def receiver_metadata(self) -> dict[str, Any]:
        """What a receiver needs to reach this sender before any put, the same for every
        key (a consumer that starts receiving while the producer is still generating has
        no put metadata yet); ``{}`` when the receiver finds payloads without it."""
        return {}

    @classmethod
    def config_for_rank(cls, config: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """The config TP rank ``rank`` of a stage uses when every rank makes a connector from
        the edge's one config (KV moves per rank). Override where ranks must differ (a
        fixed port: rank r binds port + r, :func:`offset_port`); the default: the same config."""
        return dict(config)

    @classmethod
    def reap_dead(cls, config: Mapping[str, Any], from_stage: Stage, to_stage: Stage) -> list[str]:
        """Remove the named OS resources (files, segments) that processes which are gone left
        on the edge ``from_stage -> to_stage`` with this ``config``; return their names.

        Must be safe while live processes use the edge (only a dead owner's names go). The
        default: this connector keeps no named OS resources that outlive a process. Callers
        use :func:`vllm_kvbridge.connectors.leftovers.reap_dead_leftovers`.
        """
        return []

    # -- helpers for subclasses ---------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosed(f"{self.name} is closed")

    def _put_failed(self, error: str) -> PutResult:
        """A refused put, counted (puts never raise for transport failures)."""
        self.stats.add(put_failures=1)
        return PutResult(ok=False, error=error)

    def _put_full(self, error: str) -> PutResult:
        """A put refused for lack of room now (``PutResult.full``): counted apart from
        failures, since the caller waits and puts again."""
        self.stats.add(put_full=1)
        return PutResult(ok=False, error=error, full=True)

    def _put_refused(self, refusal: Refusal) -> PutResult:
        """A put the held table refused (:mod:`~vllm_kvbridge.connectors.held_table`): full
        when room may come back, failed otherwise."""
        return self._put_full(refusal.why) if refusal.full else self._put_failed(refusal.why)

    def _reserve_slab(
        self,
        table: HeldTable[Any],
        pool: RegisteredBufferPool,
        key: str,
        nbytes: int,
        endpoint: Callable[[], str],
    ) -> Reservation | PutResult:
        """A slab of the registered ``pool`` to pack ``nbytes`` into, to be held under ``key``
        (``LentReservation.lent`` is ``(slab, endpoint())``: where receivers claim it);
        counted in ``table`` before the copy, so concurrent puts respect its byte budget.
        The refusal instead (too big, key held, full, no registered memory)."""
        self._check_open()
        self._check_key(key)
        if (refused := self._refuse_oversize(nbytes)) is not None:
            return refused
        where = endpoint()
        if (refused := table.reserve(key, nbytes)) is not None:
            return self._put_refused(refused)
        try:
            slab, _ = pool.acquire(nbytes)
        except TransferError as exc:
            table.unreserve(key)
            return self._put_failed(f"no registered memory for {nbytes} bytes: {exc}")
        return LentReservation(self, key, nbytes, memoryview(slab)[:nbytes], (slab, where))

    def _publish_slab(self, table: HeldTable[Any], r: LentReservation) -> PutResult | None:
        """Hold the written slab of ``r`` (:meth:`_reserve_slab`) in ``table``: None, or the failure."""
        if table.publish(r.key, r.lent[0]):
            return None
        return self._put_failed(
            f"{self.name} closed during put" if self._closed else f"key {r.key!r} is already held"
        )

    def _release_slab(self, table: HeldTable[Any], pool: RegisteredBufferPool, r: LentReservation) -> None:
        """A reservation of :meth:`_reserve_slab` ends unpublished: its slab and bytes go back."""
        pool.release(r.lent[0])
        table.unreserve(r.key)

    def _refuse_oversize(self, nbytes: int) -> PutResult | None:
        """The refusal of a payload over this connector's ``max_payload_bytes``, else None."""
        if nbytes > self.max_payload_bytes:
            return self._put_failed(
                f"payload of {nbytes} bytes exceeds max_payload_bytes={self.max_payload_bytes}"
            )
        return None

    @staticmethod
    def _check_key(key: str) -> None:
        if not isinstance(key, str) or not key or len(key) > MAX_KEY or not key.isascii():
            raise ConfigError(f"transfer key {key!r} must be a non-empty ASCII string of <= {MAX_KEY} chars")

    @staticmethod
    def remaining(deadline: float | None) -> float | None:
        """Seconds left until ``deadline`` (monotonic), ``None`` for no deadline, never < 0."""
        if deadline is None:
            return None
        return max(0.0, deadline - time.monotonic())

    def __enter__(self) -> Connector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass
