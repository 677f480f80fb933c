"""A thread-safe, concurrent front of :class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline`.

:class:`Pipeline` is single-threaded (one ZMQ socket, one event loop). A server needs many
callers submitting and aborting at once, so :class:`PipelineService` owns the pipeline on
one *pump thread*: callers post commands (submit, abort) to a queue, the pump thread
applies them between :meth:`Pipeline.poll` rounds and resolves one
:class:`concurrent.futures.Future` per request (``asyncio.wrap_future`` makes it awaitable).

Contract:

* :meth:`submit` returns ``(request_id, future)`` at once; the future resolves to the
  :class:`RequestResult` (its ``error`` set when the request failed in a stage, timed out or
  was aborted), or raises :class:`StageError` / :class:`PipelineError` when the pipeline is
  down. Nothing waits forever: every request has the pipeline's ``request_timeout``.
* Admission: at most ``max_in_flight`` requests are in flight (default
  :data:`DEFAULT_MAX_IN_FLIGHT`); beyond that :meth:`submit` raises :class:`Overloaded` at
  once (the server answers 429 with ``Retry-After``), so queues and memory stay bounded
  under overload instead of growing. :attr:`high_water` is the most ever in flight.
* :meth:`abort` finishes a request (``error`` = the reason) and tells every stage working on
  it to drop it; an unknown or finished id is ignored.
* A lost stage is supervised (:mod:`vllm_kvbridge.pipeline.supervision`): the requests in
  it resolve with ``error`` naming it (``lost_stage`` set); while it is restarted,
  :meth:`submit` raises :class:`~vllm_kvbridge.pipeline.results.StageRecovering` at once
  (the server answers 503 with ``Retry-After``). A stage whose restarts are spent fails
  every in-flight request with its :class:`StageError`; later submits fail the same way
  (:attr:`failure` says which stage). :meth:`health` reports each stage.
* :meth:`close` (idempotent) aborts what is in flight, stops the pump thread and closes the
  pipeline (stage processes stopped, shared-memory segments removed).
* ``submit(..., on_progress=callback)`` streams the request: ``callback`` is called on the
  pump thread with each :class:`~vllm_kvbridge.pipeline.messages.StageProgress` of the
  last stage, in order, before the future resolves (see :meth:`Pipeline.submit`). It must
  be quick (hand the delta to another thread or loop, e.g.
  ``loop.call_soon_threadsafe``); an exception it raises is swallowed, so a caller that
  went away cannot break the pump.
* ``on_result`` (optional) is called on the pump thread with every finished result
  (metrics); it must be quick and must not raise.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from vllm_kvbridge.pipeline.control_auth import new_request_id
from vllm_kvbridge.pipeline.messages import StageProgress
from vllm_kvbridge.pipeline.orchestrator import (
    POLL_S,
    Pipeline,
    PipelineError,
    RequestResult,
    StageError,
    StageRecovering,
)

#: How long the pump thread waits on the stages' socket per round (seconds); commands
#: posted meanwhile wait at most this long.
PUMP_S = 0.01
#: Requests in flight at most, unless the caller says otherwise.
DEFAULT_MAX_IN_FLIGHT = 256


class Overloaded(RuntimeError):
    """``max_in_flight`` requests are in flight: come back later (nothing was queued)."""


class PipelineService:
    def __init__(
        self,
        pipeline: Pipeline,
        *,
        on_result: Callable[[RequestResult], None] | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.pipeline = pipeline
        self.max_in_flight = max_in_flight
        self.high_water = 0
        self.on_result: Callable[[RequestResult], None] = on_result or (lambda r: None)
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._futures: dict[str, Future[RequestResult]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._failure: BaseException | None = None

    @property
    def failure(self) -> BaseException | None:
        """Why the pipeline cannot serve (a dead stage), or None. Set as soon as the
        orchestrator noticed, before it finished stopping the other stages."""
        return self._failure or self.pipeline.failure

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start every stage (blocking until ready, or raising :class:`StageError`) and
        the pump thread."""
        self.pipeline.start()
        self._thread = threading.Thread(target=self._pump, name="kvbridge-pipeline-pump", daemon=True)
        self._thread.start()

    def close(self, *, drain_s: float = 0.0) -> None:
        """Wait up to ``drain_s`` for in-flight requests, abort the rest, close everything."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + drain_s
        while self.in_flight() and time.monotonic() < deadline and self._alive():
            time.sleep(POLL_S)
        for rid in list(self._futures):
            self.abort(rid, "server shutting down")
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.pipeline.close()
        self._fail_all(PipelineError("pipeline is closed"))

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests -----------------------------------------------------------------------
    def submit(
        self,
        prompt: str,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        stage_params: Mapping[int, Mapping[str, Any]] | None = None,
        prefix: str = "req",
        on_progress: Callable[[StageProgress], None] | None = None,
    ) -> tuple[str, Future[RequestResult]]:
        """Queue a request; returns its id and a future of its :class:`RequestResult`.
        With ``on_progress`` the request streams (see the module docstring). Raises
        :class:`Overloaded` when ``max_in_flight`` requests are in flight and
        :class:`StageRecovering` while a lost stage is being restarted."""
        fut: Future[RequestResult] = Future()
        lost = self.pipeline.recovering()  # read across threads: a list built at once
        if lost and self.failure is None:
            raise StageRecovering(lost[0])
        with self._lock:
            if len(self._futures) >= self.max_in_flight:
                raise Overloaded(
                    f"{len(self._futures)} requests in flight, the limit (max_in_flight) is reached"
                )
            # Not guessable: ids name a request's KV and payload keys on the data plane.
            rid = new_request_id(prefix)
            if self._closed or self.failure is not None:
                fut.set_exception(self.failure or PipelineError("pipeline is closed"))
                return rid, fut
            self._futures[rid] = fut
            self.high_water = max(self.high_water, len(self._futures))
        progress = None if on_progress is None else _never_raising(on_progress)
        self._commands.put(("submit", (rid, prompt, dict(sampling_params or {}), stage_params, progress)))
        return rid, fut

    def abort(self, request_id: str, reason: str = "aborted by the client") -> None:
        self._commands.put(("abort", (request_id, reason)))

    def in_flight(self) -> int:
        with self._lock:
            return len(self._futures)

    def health(self) -> dict[str, Any]:
        """``{"ok": bool, "recovering": bool, "cut_off": [stage ids], "replicas_down": [(stage
        id, replica)], "stages": [...], "error": str | None}`` (see ``Pipeline.stage_health``).
        ``cut_off``: ready stages some of whose connectors cannot reach their edge's service
        (``edges_unreachable``: a Mooncake master down); they are up, but their requests over
        that edge fail. ``replicas_down``: replicas not ready (lost and restarting) of stages
        that are ready: their stage serves on its other replicas, with less room."""
        stages = self.pipeline.stage_health()
        cut_off = [s["stage_id"] for s in stages if s.get("counters", {}).get("edges_unreachable")]
        down = [
            (s["stage_id"], r["replica"])
            for s in stages
            if s["status"] == "ready"
            for r in s.get("replicas", [])
            if r["status"] != "ready"
        ]
        if self._closed or self.failure is not None:
            cut_off, down = [], []
        ready = all(s["status"] == "ready" for s in stages)
        ok = self.failure is None and not self._closed and ready and not cut_off and not down
        recovering = self.failure is None and any(s["status"] == "recovering" for s in stages)
        error = None if self.failure is None else str(self.failure)
        return {
            "ok": ok,
            "recovering": recovering,
            "cut_off": cut_off,
            "replicas_down": down,
            "stages": stages,
            "error": error,
        }

    # -- the pump thread ----------------------------------------------------------------
    def _pump(self) -> None:
        pipe = self.pipeline
        try:
            while not self._stop.is_set():
                self._apply_commands()
                try:
                    finished = pipe.poll(PUMP_S)
                except StageError as exc:
                    self._failure = exc
                    self._resolve(pipe.take_finished())
                    self._fail_all(exc)
                    return
                self._resolve(finished)
            self._apply_commands()  # aborts posted by close()
            self._resolve(pipe.poll(0))
        except BaseException as exc:  # an orchestrator bug: fail loudly, never hang callers
            self._failure = self._failure or exc
            self._fail_all(exc)

    def _apply_commands(self) -> None:
        pipe = self.pipeline
        while True:
            try:
                kind, args = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                rid, prompt, params, stage_params, progress = args
                try:
                    pipe.submit(
                        prompt, params, request_id=rid, stage_params=stage_params, on_progress=progress
                    )
                except (PipelineError, ValueError) as exc:
                    self._fail_one(rid, exc)
            elif kind == "abort":
                rid, reason = args
                pipe.abort(rid, reason)

    def _resolve(self, results: list[RequestResult]) -> None:
        for r in results:
            with self._lock:
                fut = self._futures.pop(r.request_id, None)
            try:
                self.on_result(r)
            except Exception:  # metrics must never break serving
                pass
            if fut is not None and not fut.done():
                fut.set_result(r)

    def _fail_one(self, rid: str, exc: BaseException) -> None:
        with self._lock:
            fut = self._futures.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            futures, self._futures = self._futures, {}
        for fut in futures.values():
            if not fut.done():
                fut.set_exception(exc)


def _never_raising(callback: Callable[[StageProgress], None]) -> Callable[[StageProgress], None]:
    def call(progress: StageProgress) -> None:
        try:
            callback(progress)
        except Exception:  # e.g. the caller's event loop closed: the result still resolves
            pass

    return call
