"""The transport contract every connector implements.

A connector moves one *payload* (anything the wire codec encodes: a dict of tensors,
a :class:`~vllm_kvbridge.wire.KVCacheTransferData`, ...) from a sender stage to a
receiver stage under a *key* (see :mod:`vllm_kvbridge.connectors.keys`).

Roles:
  * the sender calls :meth:`Connector.put`; the returned :class:`PutResult.metadata`
    is what the receiver needs to find the data (an address, a segment name). The
    pipeline forwards it to the receiver as "sender info".
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
"""

from __future__ import annotations

import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.errors import ConfigError, ConnectorClosed


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
#: (``serve``'s Prometheus series), by their name there.
EDGE_COUNTERS = {"expired": "leases_expired", "put_full": "puts_full"}


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
    def put(self, from_stage: int | str, to_stage: int | str, key: str, payload: Any) -> PutResult:
        """Make ``payload`` available to ``to_stage`` under ``key``."""

    @abstractmethod
    def get(
        self,
        from_stage: int | str,
        to_stage: int | str,
        key: str,
        metadata: Mapping[str, Any] | None = None,
        *,
        deadline: float | None = None,
    ) -> Any | None:
        """Return the payload stored under ``key`` (see the module docstring for semantics)."""

    def renew(
        self, from_stage: int | str, to_stage: int | str, key: str, metadata: Mapping[str, Any] | None = None
    ) -> bool:
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
    def reap_dead(cls, config: Mapping[str, Any], from_stage: int | str, to_stage: int | str) -> list[str]:
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
