"""The receiver-side claim-until-deadline loop of the pull connectors.

One implementation for every receiver that asks a sender (or a store) for a key until it is
there: ZMQ's GET, the NIXL and transfer-engine connectors' claims
(:meth:`~vllm_kvbridge.connectors.te_control.ControlClient.claim`) and the Mooncake store's
size poll. Each connector gives one *attempt* (its data plane: how it asks, what an answer
means); the loop owns the rest:

  * without a deadline, one attempt: "not there" is ``None``;
  * with one, attempts until the key is there or the deadline passes
    (:class:`TransferTimeout`). Each attempt may ask the sender to *hold* it (long poll) up
    to ``long_poll_s`` and never past the deadline (:data:`HOLD_MARGIN_S` before it, so the
    "missing" answer arrives in time): a key put meanwhile is answered on arrival;
  * an attempt answered at once (the sender held nothing: it holds too many, or there was no
    time left to hold) backs off 1 ms, doubling up to 20 ms, before it asks again; a held
    one asks again at once.

An attempt returns what it claimed, or a :class:`Retry` saying how to go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from vllm_kvbridge.errors import TransferTimeout

T = TypeVar("T")

#: First backoff after an attempt answered at once, and its cap.
FIRST_BACKOFF_S = 0.001
MAX_BACKOFF_S = 0.02
#: How much earlier than its deadline a receiver's hold ends, so "missing" arrives in time.
HOLD_MARGIN_S = 0.01


@dataclass(frozen=True)
class Retry:
    """Not claimed by this attempt. ``floor``/``cap`` bound the next backoff; ``always``:
    ask again whatever the deadline (an attempt that retries transient errors says so, and
    raises itself when it gives up)."""

    floor: float = 0.0
    cap: float = MAX_BACKOFF_S
    always: bool = False


#: The plain "not there yet" answer.
MISSING = Retry()


def hold_seconds(deadline: float | None, long_poll_s: float) -> float:
    """How long the sender may hold a request of a receiver waiting until ``deadline``
    (0: no hold, without a deadline or under a millisecond left)."""
    if deadline is None:
        return 0.0
    hold = min(long_poll_s, deadline - time.monotonic() - HOLD_MARGIN_S)
    return hold if hold >= 0.001 else 0.0


def claim_until_deadline(
    attempt: Callable[[float, float], T | Retry],
    deadline: float | None,
    *,
    not_there: str,
    check_open: Callable[[], None],
    request_timeout_s: float = 0.0,
    long_poll_s: float = 0.0,
) -> T | None:
    """Call ``attempt(hold_s, wait_until)`` until it claims (its result), see the module
    docstring. ``hold_s``: how long the sender may hold this request (0: answer at once);
    ``wait_until``: how long to wait for its answer (the deadline, or ``request_timeout_s``
    without one). ``not_there`` is the :class:`TransferTimeout` message; ``check_open``
    raises once the connector closed."""
    delay = FIRST_BACKOFF_S
    while True:
        asked = time.monotonic()
        hold = hold_seconds(deadline, long_poll_s) if long_poll_s > 0 else 0.0
        outcome = attempt(hold, deadline if deadline is not None else asked + request_timeout_s)
        if not isinstance(outcome, Retry):
            return outcome
        now = time.monotonic()
        if not outcome.always:
            if deadline is None:
                return None
            if now >= deadline:
                raise TransferTimeout(not_there)
        if not (hold and now - asked >= hold / 2):  # answered at once, not held: back off
            delay = max(delay, outcome.floor)
            left = deadline - now if deadline is not None else delay
            time.sleep(max(0.0, min(delay, left)))
            delay = min(delay * 2, outcome.cap)
        check_open()


__all__ = ["HOLD_MARGIN_S", "MISSING", "Retry", "claim_until_deadline", "hold_seconds"]
