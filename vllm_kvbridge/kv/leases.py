"""Receiver-side leases: keep what a queued request will read alive at its sender.

A sender drops a payload nobody read ``ttl_s`` after its put, unless a receiver renews it
(the connector contract, :mod:`vllm_kvbridge.connectors.base`). A consumer stage whose
queue is longer than that TTL (a diffusion stage behind a fast LLM) would otherwise find
its tail requests' KV gone. While a request waits, its stage :meth:`LeaseKeeper.hold` s
every key its producer announced (``sender_info["keys"]``: key -> put metadata, CFG
companions included); one background thread renews each every ``lease_s / 6`` (the
sender's lease, from the metadata) until :meth:`LeaseKeeper.release`. A consumer that
dies stops renewing, so the sender frees the data about one lease later.

A renewal that finds the key gone (it expired before the first renewal, or was read) is
counted (``gone``) and not retried: the request's receive then fails loudly, at its
deadline. A sender that does not answer is counted (``errors``) and retried at the next
round: a renewal is an optimisation of lifetime, never a reason to fail a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_kvbridge.connectors.base import DEFAULT_LEASE_S, RENEW_FRACTION, Connector

StageId = int | str

logger = logging.getLogger(__name__)


@dataclass
class _Lease:
    key: str
    metadata: dict[str, Any]
    every_s: float
    due: float  # monotonic


def announced_keys(sender_info: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Key -> put metadata of every piece a producer announced in its sender info."""
    keys = (sender_info or {}).get("keys") or {}
    return {str(k): dict(v or {}) for k, v in keys.items()}


class LeaseKeeper:
    """Renews the announced keys of the requests a consumer holds (see the module docstring)."""

    def __init__(self, connector: Callable[[], Connector], from_stage: StageId, to_stage: StageId) -> None:
        self._connector = connector
        self._edge = (from_stage, to_stage)
        self._lock = threading.Lock()
        self._held: dict[str, list[_Lease]] = {}
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._counts = {"renewals": 0, "gone": 0, "errors": 0}

    def hold(self, request_id: str, sender_info: Mapping[str, Any] | None) -> int:
        """Renew ``request_id``'s announced keys from now on; how many (0: nothing to keep)."""
        keys = announced_keys(sender_info)
        if not keys:
            return 0
        now = time.monotonic()
        leases = []
        for key, meta in keys.items():
            every = float(meta.get("lease_s", DEFAULT_LEASE_S)) * RENEW_FRACTION
            leases.append(_Lease(key, meta, max(every, 0.01), now))  # the first renewal at once
        with self._lock:
            if self._closed:
                return 0
            self._held[request_id] = leases
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvbridge-leases", daemon=True)
                self._thread.start()
            self._wake.notify()
        return len(leases)

    def release(self, request_id: str) -> None:
        """Stop renewing ``request_id``'s keys (it is being read, or was dropped). Idempotent."""
        with self._lock:
            self._held.pop(request_id, None)

    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def health(self) -> dict[str, int]:
        with self._lock:
            return {"held_requests": len(self._held), **self._counts}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._held.clear()
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    # -- the renewing thread ----------------------------------------------------------
    def _due(self) -> tuple[list[tuple[str, _Lease]], float]:
        """The leases due now, and how long to sleep after renewing them (lock held)."""
        now = time.monotonic()
        due = [(rid, lease) for rid, leases in self._held.items() for lease in leases if lease.due <= now]
        later = [lease.due for leases in self._held.values() for lease in leases if lease.due > now]
        return due, (min(later) - now) if later else 3600.0

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                due, sleep_s = self._due()
                if not due:
                    self._wake.wait(sleep_s)
                    continue
            for rid, lease in due:
                self._renew(rid, lease)

    def _renew(self, rid: str, lease: _Lease) -> None:
        try:
            kept = self._connector().renew(*self._edge, lease.key, lease.metadata)
        except Exception as exc:  # the sender is unreachable now: try again next round
            logger.warning("renewing %s of %s failed: %s", lease.key, rid, exc)
            kept, count = True, "errors"
        else:
            count = "renewals" if kept else "gone"
        with self._lock:
            self._counts[count] += 1
            leases = self._held.get(rid)
            if leases is None or not any(held is lease for held in leases):
                return  # released meanwhile
            if kept:
                lease.due = time.monotonic() + lease.every_s
            else:
                leases[:] = [held for held in leases if held is not lease]
                if not leases:
                    del self._held[rid]
