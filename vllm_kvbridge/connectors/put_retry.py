"""One put with retries and backpressure: what every sender (KV and payloads) calls.

Two kinds of refusal, two policies:

* a *failure* (the put raised, or returned ``ok=False``): retried ``retries`` times, spaced
  by ``backoff(i)``; then the put has failed;
* a *full* edge (``PutResult.full``: the sender holds its limit of unread bytes now): the
  same payload is put again as soon as there may be room, for up to ``send_timeout_s``
  seconds from the first full answer; those waits use up no retry. Room comes back when
  a receiver reads, a lease expires, or a failed request's data is withdrawn, so the
  sender polls (5 ms, doubling to 100 ms) instead of holding a callback into every
  connector. A put that found no room in time fails naming the limit (the connector's
  error) and the time it waited: nothing is dropped silently.

``stop`` (set at shutdown) ends any wait at once; ``cancelled`` (the request was
withdrawn meanwhile) ends a wait for room: nobody needs that room any more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_kvbridge.connectors.base import PutResult

__all__ = ["FULL_POLL_MAX_S", "PutOutcome", "put_with_retry"]

#: First and longest pause between two puts into a full edge.
FULL_POLL_MIN_S, FULL_POLL_MAX_S = 0.005, 0.1


@dataclass
class PutOutcome:
    """How a put with retries ended: ``result`` when it landed, else ``error``."""

    result: PutResult | None
    error: str | None
    attempts: int = 0  # puts tried, full answers included
    retries: int = 0  # failures retried (full answers excluded)
    full_wait_s: float = 0.0  # seconds spent waiting for room

    @property
    def ok(self) -> bool:
        return self.result is not None


def put_with_retry(
    put: Callable[[], PutResult],
    *,
    retries: int,
    backoff: Callable[[int], float],
    send_timeout_s: float,
    stop: threading.Event | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> PutOutcome:
    """Call ``put`` until it lands, fails ``retries + 1`` times, or finds the edge full for
    ``send_timeout_s`` (see the module docstring). Never raises for ``put``'s exceptions."""
    stop = stop if stop is not None else threading.Event()
    out = PutOutcome(None, "no attempt")
    failures = 0
    full_since: float | None = None
    pause = FULL_POLL_MIN_S
    while True:
        if stop.is_set():
            out.error = "shut down while sending"
            return out
        out.attempts += 1
        try:
            result = put()
        except Exception as exc:
            result = PutResult(ok=False, error=f"{type(exc).__name__}: {exc}")
        if result.ok:
            out.result, out.error = result, None
            if full_since is not None:
                out.full_wait_s = time.monotonic() - full_since
            return out
        if result.full:
            now = time.monotonic()
            full_since = now if full_since is None else full_since
            out.full_wait_s = now - full_since
            if cancelled is not None and cancelled():
                out.error = f"withdrawn while waiting for room: {result.error or 'edge full'}"
                return out
            if out.full_wait_s >= send_timeout_s:
                out.error = (
                    f"edge full for {out.full_wait_s:.1f} s (send_timeout {send_timeout_s:g} s): "
                    f"{result.error or 'no room'}"
                )
                return out
            stop.wait(min(pause, send_timeout_s - out.full_wait_s))
            pause = min(2 * pause, FULL_POLL_MAX_S)
            continue
        full_since, pause = None, FULL_POLL_MIN_S
        out.error = result.error or "put returned ok=False"
        if failures >= retries:
            out.error = f"{out.error} (after {failures + 1} failed attempts)"
            return out
        stop.wait(backoff(failures))
        failures += 1
        out.retries = failures
