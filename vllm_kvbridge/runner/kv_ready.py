"""Which of a diffusion stage's queued requests can run now without waiting for their KV.

A stage that takes its queue head whose KV is late waits in that receive for up to
``recv_timeout`` while the requests behind it, whose KV has arrived, wait too (issue 36:
p50 124 s on a bad link). :class:`KVReadiness` lets it take a ready one first:

* it prefetches the KV of the first ``window`` queued requests (arrival order) from the
  moment each is queued (:meth:`~KVReadiness.hold`, the runner's ``hold_kv``), and the
  next ones as requests leave the queue (:meth:`~KVReadiness.leave`, ``release_kv``), so
  each request's one receive deadline runs while it waits, not after the requests before
  it; ``window`` is ``max(max_prefetch_inflight, max_batch_size)``: what it pulls in ahead
  of use is bounded like any prefetch;
* :meth:`~KVReadiness.ready`: taking the request now waits for nothing: its prefetch
  finished (the KV arrived, or it failed and the request fails at once), or it has none
  and will get none (prefetch skipped, or withdrawn: received or dropped when taken, as
  before). A queued request beyond the window, or whose prefetch runs, is not ready;
* :meth:`~KVReadiness.listen`: told when a prefetch finished, so a worker with nothing
  ready sleeps until one is (each prefetch ends by its own deadline, so it does).

Requests the stage never queued through :meth:`~KVReadiness.hold` are always ready.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vllm_kvbridge.kv.prefetch import KVPrefetcher

__all__ = ["KVReadiness"]

logger = logging.getLogger(__name__)


class KVReadiness:
    """Prefetch window and readiness of a diffusion stage's queue (module docstring).

    ``start(req)`` starts ``req``'s prefetch and says whether it did; ``prefetcher`` is the
    manager's, asked which prefetches finished.
    """

    def __init__(self, start: Callable[[Any], bool], prefetcher: KVPrefetcher, window: int) -> None:
        self._start, self._prefetcher, self._window = start, prefetcher, max(1, window)
        self._lock = threading.Lock()
        self._queued: OrderedDict[str, Any] = OrderedDict()  # transfer id -> request, arrival order
        self._started: set[str] = set()  # queued ids whose prefetch this started
        self._none: set[str] = set()  # queued ids that get no prefetch (it was not started)
        self._listeners: list[Callable[[], None]] = []

    def listen(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on a prefetch thread) whenever a queued request's prefetch finished."""
        with self._lock:
            self._listeners.append(callback)

    def hold(self, rid: str, req: Any) -> None:
        """``req`` (transfer id ``rid``) joined the queue: prefetch it if the window has room."""
        with self._lock:
            self._queued[rid] = req
        self._fill()

    def leave(self, rid: str) -> None:
        """``rid`` left the queue (taken, or dropped): the window moves on."""
        with self._lock:
            self._queued.pop(rid, None)
            self._started.discard(rid)
            self._none.discard(rid)
        self._fill()

    def ready(self, rid: str) -> bool:
        """Whether taking ``rid`` now waits for nothing (module docstring)."""
        with self._lock:
            if rid not in self._queued:
                return True
            started, without = rid in self._started, rid in self._none
        state = self._prefetcher.ready(rid)
        if state is not None:
            return state
        # No prefetch of it now: one that was started is gone (withdrawn, or consumed), and
        # one that could not start will not: either way it is received when taken.
        return started or without

    def _fill(self) -> None:
        """Start the prefetches of the first ``window`` queued requests not started yet.
        Under the lock: a request that left the queue (about to be received by the
        worker) is never prefetched after that, which would wait for KV already consumed."""
        done: list[str] = []
        with self._lock:
            active = len(self._started)
            for rid, req in self._queued.items():
                if active >= self._window:
                    break
                if rid in self._started or rid in self._none:
                    continue
                try:
                    started = self._start(req)
                except Exception:  # e.g. shut down: received (and failed) when taken
                    logger.exception("KV prefetch of %s could not start", rid)
                    started = False
                if started or self._prefetcher.ready(rid) is not None:
                    self._started.add(rid)  # started now, or by an earlier prefetch call
                    active += 1
                    done.append(rid)
                else:
                    self._none.add(rid)  # prefetch off, or no memory for it: taken as it is
        for rid in done:
            self._prefetcher.when_done(rid, self._finished)

    def _finished(self, rid: str) -> None:
        with self._lock:
            listeners = list(self._listeners) if rid in self._queued else []
        for callback in listeners:
            try:
                callback()
            except Exception:  # a listener's bug must not fail the prefetch's thread
                logger.exception("KV readiness listener failed")
