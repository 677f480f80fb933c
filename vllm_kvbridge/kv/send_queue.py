"""KV puts that wait for room side by side: each request against its own deadline.

Before (issue 36) one I/O thread put the jobs one after the other, each waiting up to
``send_timeout`` for room on a full edge: with the edge full, request ``k`` waited
``k x send_timeout`` (60, 120, ... 300 s, two 504s), and a request held in the engine's
blocks started its ``send_timeout`` again once gathered. :class:`KVSendQueue` reports each
job (``done`` / ``failed``, queued bytes, copies in flight, sender info) and runs it as a
task of a :class:`~vllm_kvbridge.connectors.put_retry.PutScheduler`: a put that finds the edge full
or backs off holds no thread, so every waiting request is retried and failed on its own,
and its wait for room ends at *its* deadline, ``send_timeout`` after its request's send
started (:meth:`deadlines`; by default when the job was submitted). The put policy itself
is :class:`~vllm_kvbridge.connectors.put_retry.PutAttempt`, the same one
``put_with_retry`` runs.

"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.connectors.put_retry import PutAttempt, PutScheduler
from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.metrics import KVTransferMetrics
from vllm_kvbridge.kv.send import SendJob
from vllm_kvbridge.kv.sender_info import SentInfoTable
from vllm_kvbridge.wire.staging import Fence

__all__ = ["KV_SEND_WORKERS", "KVSendQueue"]

logger = logging.getLogger(__name__)

#: I/O threads per KV edge. Waits hold none (they are scheduled); two so that one put the
#: connector itself takes long over (a slow link) leaves the other requests a thread.
KV_SEND_WORKERS = 2
#: Failure reasons kept readable after they were reported (the newest ids).
_MAX_REASONS = 1024


class KVSendQueue:
    """Puts :class:`SendJob` s side by side, each against its own deadline, and reports them
    (module docstring).

    ``connector`` is called for the connector at each attempt (so a failed creation is
    retried); ``stop`` interrupts backoffs and fails the jobs not started yet.
    """

    def __init__(
        self,
        config: KVTransferConfig,
        connector: Callable[[], Connector],
        metrics: KVTransferMetrics,
        sent_info: SentInfoTable,
        stop: threading.Event,
        workers: int = KV_SEND_WORKERS,
    ) -> None:
        self._config, self._connector, self._metrics = config, connector, metrics
        self._sent_info, self._stop = sent_info, stop
        self._lock = threading.Lock()
        self._scheduler = PutScheduler("kvbridge-kv-send", workers)
        self._deadlines: dict[str, float] = {}  # engine id -> its send's deadline, until submitted
        self._pending: set[str] = set()
        self._copying: dict[str, Fence] = {}  # engine id -> fence of a staged copy not waited for
        self._queued_bytes = 0  # gathered KV not put yet (queued or being put)
        self._done: list[str] = []
        self._failed: dict[str, str] = {}
        self._reasons: OrderedDict[str, str] = OrderedDict()  # bounded by _MAX_REASONS
        #: called (no lock held, on the thread that settled it) once a send is done or
        #: failed, so its owner reports it without waiting for anyone to ask
        self.on_settled: Callable[[], None] | None = None

    def fail(self, engine_id: str, reason: str) -> None:
        """Report ``engine_id`` failed without sending (e.g. its gather failed)."""
        self._metrics.failure("send")
        with self._lock:
            self._failed[engine_id] = reason
        self._tell_settled()

    def _tell_settled(self) -> None:
        if self.on_settled is not None:
            try:
                self.on_settled()
            except Exception:  # the report is the owner's; never the I/O thread's death
                logger.exception("kvbridge: reporting a settled KV send failed")

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(done, failed)`` engine ids since the last call; each id is reported once.
        Why each failed stays readable with :meth:`failure_reason` (the newest ids only)."""
        with self._lock:
            done, self._done = set(self._done), []
            failed = set(self._failed)
            for rid, why in self._failed.items():
                self._reasons[rid] = why
                self._reasons.move_to_end(rid)
            while len(self._reasons) > _MAX_REASONS:
                self._reasons.popitem(last=False)
            self._failed.clear()
        return done, failed

    def failure_reason(self, engine_id: str) -> str | None:
        """Why the send of ``engine_id`` failed (once reported by :meth:`get_finished`)."""
        with self._lock:
            return self._reasons.get(engine_id)

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def copies_in_flight(self, engine_ids: set[str]) -> set[str]:
        """Which of ``engine_ids`` have a staged copy still reading their blocks: their
        blocks must not go back to vLLM yet (``finished_sending`` waits for them)."""
        with self._lock:
            fences = {e: self._copying.get(e) for e in engine_ids}
        return {e for e, fence in fences.items() if fence is not None and not fence.done()}

    def queued_bytes(self) -> int:
        """Bytes of gathered KV whose puts have not completed: what a full edge makes grow,
        so a caller holds its next gathers (in the engine's blocks) while it is over budget."""
        with self._lock:
            return self._queued_bytes

    def withdraw_keys(self, keys: list[str]) -> None:
        """``cleanup`` each of ``keys`` (put by this stage, never to be consumed)."""
        for key in keys:
            try:
                self._connector().cleanup(key)
            except Exception as exc:  # withdraw the others anyway; the TTL reaper is the backstop
                logger.warning("KV withdraw: cleanup(%s) failed: %s", key, exc)

    @contextlib.contextmanager
    def deadlines(self, by_engine_id: Mapping[str, float]) -> Iterator[None]:
        """Within the block, a job submitted for one of these engine ids waits for room until
        its deadline (monotonic); entries not used by then are dropped (a gather deferred
        or failed: the caller names the deadline again at its next try)."""
        with self._lock:
            self._deadlines.update(by_engine_id)
        try:
            yield
        finally:
            with self._lock:
                for engine_id in by_engine_id:
                    self._deadlines.pop(engine_id, None)

    def submit(self, job: SendJob) -> None:
        with self._lock:
            self._pending.add(job.engine_id)
            self._queued_bytes += job.nbytes
            if job.fence is not None:
                self._copying[job.engine_id] = job.fence
            deadline = self._deadlines.pop(job.engine_id, None)
        if deadline is None:
            deadline = time.monotonic() + self._config.send_timeout
        self._metrics.transfer_started("send")
        self._scheduler.submit(_SendTask(self, job, deadline))

    def _settle(self, job: SendJob, error: str | None) -> None:
        """``job`` ended (``error`` None: every part landed): report it, free what it held."""
        job.release()  # what was not published (a failed or cancelled send)
        with self._lock:
            self._pending.discard(job.engine_id)
            self._copying.pop(job.engine_id, None)
            self._queued_bytes -= job.nbytes
            if error is None:
                self._done.append(job.engine_id)
            else:
                self._failed[job.engine_id] = error
        if error is not None:
            logger.error("KV send of request %s failed: %s", job.engine_id, error)
            self._metrics.failure("send")
        self._metrics.transfer_ended("send")
        self._tell_settled()

    def shutdown(self, timeout: float) -> None:
        """End every send (``stop`` must be set: waits end at once, jobs not started fail
        with "manager shut down") and join the I/O threads."""
        self._scheduler.hurry()
        alive = self._scheduler.close(timeout)
        if alive:
            logger.warning("%d KV send threads did not stop within %.1f s", alive, timeout)


class _SendTask:
    """One job as a scheduler task: its fence, then each part's put in turn (waits for room
    and backoffs return to the scheduler), then its sender info; settled once."""

    def __init__(self, queue: KVSendQueue, job: SendJob, deadline: float) -> None:
        self._queue, self._job, self._deadline = queue, job, deadline
        self._began = False
        self._part = 0
        self._attempt: PutAttempt | None = None
        self._start = 0.0
        self._infos: dict[str, Any] = {"ranks": {}, "keys": {}}
        self._put_keys: list[str] = []

    def __call__(self) -> float | None:
        try:
            wake, error = self._advance()
        except Exception as exc:  # never let a job go unreported
            wake, error = None, f"unexpected: {exc!r}"
        if wake is not None:
            return wake
        self._queue._settle(self._job, error)
        self._job = None  # type: ignore[assignment]  # the gathered KV goes now
        return None

    def _advance(self) -> tuple[float | None, str | None]:
        """``(when to run again, None)`` while a put waits, else ``(None, error or None)``."""
        queue, job, cfg = self._queue, self._job, self._queue._config
        if not self._began:
            self._began = True
            if queue._stop.is_set():
                return None, "manager shut down"
            if job.fence is not None:
                try:  # the staged gather (on the copy stream) must have completed: bounded work
                    job.fence.wait()
                except Exception as exc:
                    return None, f"gather failed: {type(exc).__name__}: {exc}"
        while self._part < len(job.parts):
            key, rank, reservation = job.parts[self._part]
            if self._attempt is None:
                self._start = time.perf_counter()
                self._attempt = PutAttempt(
                    reservation.publish,
                    retries=cfg.send_retries,
                    backoff=cfg.backoff,
                    send_timeout_s=cfg.send_timeout,
                    deadline=self._deadline,
                    stop=queue._stop,
                    # A request withdrawn while its put waits for room needs no room any more.
                    cancelled=lambda: queue._sent_info.is_withdrawn(job.request_id),
                )
            wake = self._attempt.step()
            if wake is not None:
                return wake, None
            outcome, self._attempt = self._attempt.outcome, None
            for _ in range(outcome.retries):
                queue._metrics.retry("send")
            if outcome.full_wait_s:
                queue._metrics.full_wait(outcome.full_wait_s)
            if outcome.result is None:
                queue.withdraw_keys(self._put_keys)  # release what this request already put
                return None, f"{key}: {outcome.error}"
            self._infos["ranks"][str(rank)] = outcome.result.metadata
            self._infos["keys"][key] = outcome.result.metadata
            self._put_keys.append(key)
            queue._metrics.success("send", outcome.result.nbytes, time.perf_counter() - self._start)
            self._part += 1
        self._infos["num_kv_heads"] = job.num_kv_heads  # lets a receiver that is not configured check
        if not queue._sent_info.record((job.engine_id, job.request_id), self._infos):
            # Withdrawn while it was being sent (its request failed elsewhere): nobody will
            # consume it. The send itself did complete, so it is reported done.
            queue.withdraw_keys(self._put_keys)
        return None, None
