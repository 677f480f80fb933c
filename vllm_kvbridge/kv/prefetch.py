"""Async prefetch: receive the KV of requests that will be needed soon, in the background.

:class:`KVPrefetcher` runs at most ``max_inflight`` receives at once on a thread pool and
hands out their futures by request id. :meth:`KVPrefetcher.take` turns a finished one into
its result: ``None`` for a recoverable failure (nothing was consumed: a transport error;
the caller receives synchronously), :class:`KVPrefetchConsumeError` when a payload was
consumed but could not be used (the data is gone, so it is not retried).

One deadline per request: a prefetch that timed out *is* the request's receive, over at
its deadline (``recv_timeout`` from when the prefetch began), so :meth:`~KVPrefetcher.take`
raises its :class:`~vllm_kvbridge.errors.TransferTimeout` instead of letting the caller
wait a second ``recv_timeout`` synchronously while the requests behind it wait too (issue
36: 30 s of prefetch, then 30 s more). :meth:`~KVPrefetcher.ready` and
:meth:`~KVPrefetcher.when_done` tell a consumer whose queue holds several requests which
ones it can take now without waiting (the diffusion stage takes those first, so a late KV
holds up no request behind it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from vllm_kvbridge.errors import KVBridgeError, TransferError, TransferTimeout
from vllm_kvbridge.kv.receive import Consumed, ReceivedKV, request_id_of

logger = logging.getLogger(__name__)

__all__ = ["KVPrefetchConsumeError", "KVPrefetcher", "free_memory_ratio"]


class KVPrefetchConsumeError(TransferError):
    """A prefetched KV payload was consumed but could not be used; it is not retried."""


def free_memory_ratio(device: torch.device) -> float:
    """Free / total memory of ``device`` (host memory for CPU; 1.0 when unknown)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free / total
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        total = int(info["MemTotal"].split()[0])
        avail = int(info["MemAvailable"].split()[0])
        return avail / total
    except (OSError, KeyError, ValueError):
        return 1.0


class KVPrefetcher:
    """Background receives by request id, at most ``max_inflight`` at once.

    At most ``max_kept`` prefetches (running or finished, not yet consumed) are tracked:
    the oldest finished ones are dropped beyond that (``on_drop`` is told), and while all
    of them still run no new one starts (its request is received when it is consumed).
    """

    def __init__(
        self, max_inflight: int, max_kept: int = 256, on_drop: Callable[[str], None] | None = None
    ) -> None:
        self._max_inflight = max_inflight
        self._max_kept, self._on_drop = max_kept, on_drop
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._futures: dict[str, Future[ReceivedKV]] = {}
        self._closed = False

    def start(self, jobs: Iterable[Any], receive: Callable[[str, Any, Any], ReceivedKV]) -> list[str]:
        """Submit ``receive(rid, req, sender_info)`` for each job not already in flight.

        A job is a request (or its id) or ``(request, sender_info)``; returns the ids started.
        """
        started = []
        with self._lock:
            if self._closed:
                raise TransferError("KV transfer manager is shut down")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self._max_inflight, thread_name_prefix="kvbridge-prefetch"
                )
            dropped = []
            for job in jobs:
                req, info = job if isinstance(job, tuple) else (job, None)
                rid = request_id_of(req)
                if rid in self._futures:
                    continue
                if len(self._futures) >= self._max_kept:
                    dropped += self._drop_finished_locked(len(self._futures) - self._max_kept + 1)
                if len(self._futures) >= self._max_kept:
                    break  # all still running: the rest are received when consumed
                self._futures[rid] = self._executor.submit(receive, rid, req, info)
                started.append(rid)
        for rid in dropped:
            logger.warning("prefetched KV of %s dropped unconsumed (over max_unconsumed)", rid)
            if self._on_drop is not None:
                self._on_drop(rid)
        return started

    def _drop_finished_locked(self, n: int) -> list[str]:
        """Forget up to ``n`` of the oldest finished prefetches; their results are released."""
        gone = [rid for rid, f in self._futures.items() if f.done()][:n]
        for rid in gone:
            del self._futures[rid]
        return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._futures)

    def pop(self, rid: str) -> Future[ReceivedKV] | None:
        with self._lock:
            return self._futures.pop(rid, None)

    def ready(self, rid: str) -> bool | None:
        """Whether ``rid``'s prefetch finished (arrived, or failed: taking it waits for
        nothing); None when there is no prefetch of it."""
        with self._lock:
            future = self._futures.get(rid)
        return None if future is None else future.done()

    def when_done(self, rid: str, callback: Callable[[str], None]) -> bool:
        """Call ``callback(rid)`` once ``rid``'s prefetch finished (at once if it has; on the
        prefetch's thread otherwise); False when there is no prefetch of it."""
        with self._lock:
            future = self._futures.get(rid)
        if future is None:
            return False
        future.add_done_callback(lambda _: callback(rid))
        return True

    @staticmethod
    def take(
        rid: str, future: Future[ReceivedKV], on_consumed: Callable[[], None] | None = None
    ) -> ReceivedKV | None:
        """The prefetch's result, ``None`` when it failed recoverably (see the module
        docstring); raises the :class:`TransferTimeout` of one that timed out.

        ``on_consumed`` runs before this raises (a leader tells its followers).
        """
        try:
            return future.result()
        except TransferTimeout:
            if on_consumed is not None:
                on_consumed()
            raise  # its deadline passed: a second receive would only wait it out again
        except Consumed as exc:
            if on_consumed is not None:
                on_consumed()
            raise KVPrefetchConsumeError(
                f"prefetched KV of {rid} was consumed but unusable: {exc.cause}"
            ) from exc.cause
        except (KVBridgeError, OSError) as exc:
            logger.info("KV prefetch of %s failed (%s); receiving synchronously", rid, exc)
            return None

    def in_flight(self) -> int:
        with self._lock:
            return sum(1 for f in self._futures.values() if not f.done())

    def shutdown(self) -> None:
        """Cancel what has not started, wait for the rest (the receives see the stop flag)."""
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
            futures = list(self._futures.values())
            self._futures.clear()
        for f in futures:
            f.cancel()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
