"""One put with retries and backpressure: what every sender (KV and payloads) calls.

Two kinds of refusal, two policies:

* a *failure* (the put raised, or returned ``ok=False``): retried ``retries`` times, spaced
  by ``backoff(i)``; then the put has failed;
* a *full* edge (``PutResult.full``: the sender holds its limit of unread bytes now): the
  same payload is put again as soon as there may be room, for up to ``send_timeout_s``
  seconds from the first full answer, and never past ``deadline`` (the end of its
  request's own ``send_timeout``, counted from when that request started or was held);
  those waits use up no retry. Room comes back when a receiver reads, a lease expires, or
  a failed request's data is withdrawn, so the sender polls (5 ms, doubling to 100 ms)
  instead of holding a callback into every connector. A put that found no room in time
  fails naming the limit (the connector's error) and the time it waited: nothing is
  dropped silently.

``stop`` (set at shutdown) ends any wait at once; ``cancelled`` (the request was
withdrawn meanwhile) ends a wait for room: nobody needs that room any more.

The policy lives in :class:`PutAttempt`, which puts once per :meth:`~PutAttempt.step` and
says when to try again, so a wait holds no thread: :class:`PutScheduler` runs many
attempts (a KV edge's requests, a payload edge's) on a few I/O threads, each waiting out
its own edge-full time against its own deadline. That is why a full edge is waited out in
parallel: a request's wait for room never waits behind another request's (issue 36).
:func:`put_with_retry` is the same attempt run to its end on the calling thread.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_kvbridge.connectors.base import PutResult

__all__ = ["FULL_POLL_MAX_S", "PutAttempt", "PutOutcome", "PutScheduler", "put_with_retry"]

logger = logging.getLogger(__name__)

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


class PutAttempt:
    """One payload's put with retries and backpressure, one try per :meth:`step` (the
    module docstring has the policy). ``deadline`` (monotonic) is when its request's time
    to find room ends, whenever this put started; None: ``send_timeout_s`` after the
    first full answer."""

    def __init__(
        self,
        put: Callable[[], PutResult],
        *,
        retries: int,
        backoff: Callable[[int], float],
        send_timeout_s: float,
        deadline: float | None = None,
        stop: threading.Event | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        self._put, self._retries, self._backoff = put, retries, backoff
        self.send_timeout_s, self.deadline = send_timeout_s, deadline
        self._stop, self._cancelled = stop, cancelled
        self.outcome = PutOutcome(None, "no attempt")
        self._failures = 0
        self._full_since: float | None = None
        self._pause = FULL_POLL_MIN_S

    def step(self) -> float | None:
        """Put once. None when the attempt is over (:attr:`outcome` says how), else the
        monotonic time of the next try (no sooner: a full edge or a backoff)."""
        out = self.outcome
        if self._stop is not None and self._stop.is_set():
            out.error = "shut down while sending"
            return None
        out.attempts += 1
        try:
            result = self._put()
        except Exception as exc:
            result = PutResult(ok=False, error=f"{type(exc).__name__}: {exc}")
        now = time.monotonic()
        if result.ok:
            out.result, out.error = result, None
            if self._full_since is not None:
                out.full_wait_s = now - self._full_since
            return None
        if result.full:
            self._full_since = now if self._full_since is None else self._full_since
            out.full_wait_s = now - self._full_since
            if self._cancelled is not None and self._cancelled():
                out.error = f"withdrawn while waiting for room: {result.error or 'edge full'}"
                return None
            end = self._full_since + self.send_timeout_s
            own = self.deadline is not None and self.deadline < end
            end = min(end, self.deadline) if self.deadline is not None else end
            if now >= end:
                since = " counted from its request's start" if own else ""
                out.error = (
                    f"edge full for {out.full_wait_s:.1f} s (send_timeout {self.send_timeout_s:g} s"
                    f"{since}): {result.error or 'no room'}"
                )
                return None
            wake = min(now + self._pause, end)
            self._pause = min(2 * self._pause, FULL_POLL_MAX_S)
            return wake
        self._full_since, self._pause = None, FULL_POLL_MIN_S
        out.error = result.error or "put returned ok=False"
        if self._failures >= self._retries:
            out.error = f"{out.error} (after {self._failures + 1} failed attempts)"
            return None
        wake = now + self._backoff(self._failures)
        self._failures += 1
        out.retries = self._failures
        return wake


def put_with_retry(
    put: Callable[[], PutResult],
    *,
    retries: int,
    backoff: Callable[[int], float],
    send_timeout_s: float,
    stop: threading.Event | None = None,
    cancelled: Callable[[], bool] | None = None,
    deadline: float | None = None,
) -> PutOutcome:
    """Call ``put`` until it lands, fails ``retries + 1`` times, or finds the edge full for
    ``send_timeout_s`` (or until ``deadline``), waiting on this thread (see the module
    docstring). Never raises for ``put``'s exceptions."""
    stop = stop if stop is not None else threading.Event()
    attempt = PutAttempt(
        put,
        retries=retries,
        backoff=backoff,
        send_timeout_s=send_timeout_s,
        deadline=deadline,
        stop=stop,
        cancelled=cancelled,
    )
    while (wake := attempt.step()) is not None:
        stop.wait(max(0.0, wake - time.monotonic()))
    return attempt.outcome


#: A task of a :class:`PutScheduler`: does some work, then returns the monotonic time it
#: wants to run again, or None when it is over. It never raises (errors are its outcome).
Task = Callable[[], "float | None"]


class PutScheduler:
    """Runs many waiting sends on ``workers`` threads: a task that waits (for room, for a
    backoff) returns when it wants to run again and holds no thread meanwhile, so one
    request waiting for room never keeps another's put from being tried. Threads run
    whichever task is due first (ties in submission order); a task never runs on two
    threads at once. ``workers`` > 1 only so that a put that takes long in the connector
    itself (a slow link) leaves the other tasks a thread.
    """

    def __init__(self, name: str, workers: int = 1, *, start: bool = False) -> None:
        if workers < 1:
            raise ValueError(f"a put scheduler needs at least one worker, got {workers}")
        self._name, self._workers = name, workers
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, Task]] = []
        self._seq = itertools.count()
        self._running = 0  # tasks being stepped now
        self._hurry = False  # every task is due now (their stop flag was set)
        self._closed = False
        self._threads: list[threading.Thread] = []
        if start:
            with self._lock:
                self._start_locked()

    def _start_locked(self) -> None:
        if self._threads:
            return
        self._threads = [
            threading.Thread(target=self._loop, name=f"{self._name}-{i}", daemon=True)
            for i in range(self._workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, task: Task, at: float | None = None) -> None:
        """Run ``task`` at ``at`` (monotonic; default now), then whenever it asks."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name}: the put scheduler is closed")
            self._start_locked()
            heapq.heappush(self._heap, (time.monotonic() if at is None else at, next(self._seq), task))
            self._cond.notify()

    def tasks(self) -> int:
        """Tasks waiting or being stepped."""
        with self._lock:
            return len(self._heap) + self._running

    def hurry(self) -> None:
        """Make every task due now and from now on: call once their stop flag is set, so a
        wait for room or a backoff ends at once instead of at its next try."""
        with self._cond:
            self._hurry = True
            self._cond.notify_all()

    def close(self, timeout: float) -> int:
        """Take no more tasks, let the threads finish the ones there are (up to
        ``timeout``, shared), and return how many threads are still alive."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads = list(self._threads)
        end = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))
        return self.threads_alive()

    def threads_alive(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def _next(self) -> Task | None:
        """The next due task (waits for it), or None once closed with nothing left."""
        with self._cond:
            while True:
                if self._heap:
                    wake = self._heap[0][0]
                    now = time.monotonic()
                    if self._hurry or wake <= now:
                        task = heapq.heappop(self._heap)[2]
                        self._running += 1
                        return task
                    self._cond.wait(wake - now)
                elif self._closed and not self._running:
                    return None
                else:  # a task being stepped may come back: woken when it is done
                    self._cond.wait()

    def _loop(self) -> None:
        while (task := self._next()) is not None:
            try:
                wake = task()
            except Exception:  # a task reports its own errors; never let a thread die
                logger.exception("%s: a send task raised", self._name)
                wake = None
            with self._cond:
                self._running -= 1
                if wake is not None:
                    heapq.heappush(self._heap, (wake, next(self._seq), task))
                self._cond.notify_all()
