"""Transfer metrics of the KV manager: a ``health()`` dict and Prometheus series.

Prometheus series are created once per process (module level, under a lock) in
``prometheus_client``'s default registry, so any number of managers can exist without
"Duplicated timeseries" errors; each manager only picks its label children. Labels are
low-cardinality on purpose: ``stage``, ``direction`` (``send``/``recv``) and
``connector``, never a request id.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["KVTransferMetrics"]

_prom_lock = threading.Lock()
_prom: dict[str, Any] | None = None
_LABELS = ("stage", "direction", "connector")


def _prometheus() -> dict[str, Any] | None:
    """The process-wide metric families (None when prometheus_client is unavailable)."""
    global _prom
    with _prom_lock:
        if _prom is not None:
            return _prom
        try:
            from prometheus_client import Counter, Gauge, Histogram
        except ImportError:  # pragma: no cover - prometheus_client is a dependency
            return None
        _prom = {
            "transfers": Counter("kvbridge_kv_transfers", "KV transfers completed", _LABELS),
            "bytes": Counter("kvbridge_kv_transfer_bytes", "Bytes of KV moved", _LABELS),
            "failures": Counter("kvbridge_kv_transfer_failures", "KV transfers failed", _LABELS),
            "timeouts": Counter("kvbridge_kv_transfer_timeouts", "KV receives that timed out", _LABELS),
            "retries": Counter("kvbridge_kv_transfer_retries", "KV send retries", _LABELS),
            "full_waits": Counter(
                "kvbridge_kv_send_full_waits", "KV puts that waited for room on a full edge", _LABELS
            ),
            "full_wait_seconds": Counter(
                "kvbridge_kv_send_full_wait_seconds", "Seconds KV puts waited for room", _LABELS
            ),
            "unconsumed_dropped": Counter(
                "kvbridge_kv_unconsumed_dropped",
                "Received or prefetched KV dropped unconsumed (over max_unconsumed)",
                _LABELS,
            ),
            "seconds": Histogram(
                "kvbridge_kv_transfer_seconds",
                "Seconds per KV transfer",
                _LABELS,
                buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0),
            ),
            "in_flight": Gauge("kvbridge_kv_transfers_in_flight", "KV transfers in flight", _LABELS),
        }
        return _prom


class KVTransferMetrics:
    """Thread-safe counters of one manager, mirrored into Prometheus."""

    _COUNTERS = (
        "transfers",
        "bytes",
        "failures",
        "timeouts",
        "retries",
        "full_waits",
        "full_wait_seconds",
        "unconsumed_dropped",
    )

    def __init__(self, stage: int | str, connector: str) -> None:
        self._lock = threading.Lock()
        self._labels = {"stage": str(stage), "connector": str(connector)}
        self._values = {d: {name: 0 for name in (*self._COUNTERS, "in_flight")} for d in ("send", "recv")}
        self._seconds = {"send": 0.0, "recv": 0.0}
        self._last: dict[str, dict[str, float]] = {}
        self._prom = _prometheus()

    def _child(self, name: str, direction: str) -> Any:
        return self._prom[name].labels(direction=direction, **self._labels) if self._prom else None

    def _inc(self, direction: str, name: str, amount: float = 1) -> None:
        with self._lock:
            self._values[direction][name] += amount
        child = self._child(name, direction)
        if child is not None:
            child.inc(amount)

    def transfer_started(self, direction: str) -> None:
        with self._lock:
            self._values[direction]["in_flight"] += 1
        child = self._child("in_flight", direction)
        if child is not None:
            child.inc()

    def transfer_ended(self, direction: str) -> None:
        with self._lock:
            self._values[direction]["in_flight"] -= 1
        child = self._child("in_flight", direction)
        if child is not None:
            child.dec()

    def success(self, direction: str, nbytes: int, seconds: float) -> None:
        self._inc(direction, "transfers")
        self._inc(direction, "bytes", nbytes)
        with self._lock:
            self._seconds[direction] += seconds
            self._last[direction] = {"bytes": nbytes, "seconds": seconds}
        child = self._child("seconds", direction)
        if child is not None:
            child.observe(seconds)

    def failure(self, direction: str) -> None:
        self._inc(direction, "failures")

    def timeout(self, direction: str) -> None:
        self._inc(direction, "timeouts")

    def retry(self, direction: str) -> None:
        self._inc(direction, "retries")

    def full_wait(self, seconds: float) -> None:
        """A put waited ``seconds`` for room on a full edge before it landed or gave up."""
        self._inc("send", "full_waits")
        self._inc("send", "full_wait_seconds", seconds)

    def unconsumed_dropped(self) -> None:
        self._inc("recv", "unconsumed_dropped")

    def in_flight(self, direction: str) -> int:
        with self._lock:
            return int(self._values[direction]["in_flight"])

    def health(self) -> dict[str, Any]:
        """JSON-safe snapshot: per direction counters, seconds, last transfer."""
        with self._lock:
            return {
                **self._labels,
                **{
                    d: {**self._values[d], "seconds": self._seconds[d], "last": dict(self._last.get(d, {}))}
                    for d in ("send", "recv")
                },
            }
