"""The orchestrator: one process per stage, requests routed stage to stage.

``Pipeline`` starts every stage as ``python -m vllm_kvbridge.pipeline.stage_process`` in
its own session (here, or on the node a Ray actor holds for it: see
:mod:`vllm_kvbridge.pipeline.placement`), binds the edges left ``auto`` to a connector for
where their stages run, hands each stage its :class:`ResolvedStage` as JSON on stdin, and
talks to it over one ZMQ ROUTER socket (msgspec messages, see :mod:`vllm_kvbridge.pipeline.messages`)
admitting only the processes it started (:mod:`vllm_kvbridge.pipeline.control_auth`).
A request enters the first stage; when a stage reports it done, the sender info it
reported is forwarded with the request to the next stage; the last stage's output is
the request's result (what is known of each request is kept in a
:class:`~vllm_kvbridge.pipeline.request_book.RequestBook`). Any number of requests are in
flight at once. A request submitted with ``on_progress`` streams: its last stage is asked
to report partial output (``Submit.stream``) and every
:class:`~vllm_kvbridge.pipeline.messages.StageProgress` it sends is handed to the
callback, in order, before the request finishes. A stage with ``replicas: N`` is N such
processes, and each request goes to one of them per stage
(:class:`~vllm_kvbridge.pipeline.replicas.StageReplicas`); what follows of "a stage" holds
for each replica on its own, except that a stage refuses new requests only while every
replica of it is being restarted.

Failure and shutdown contract:

* a stage that fails while the pipeline starts ends it: every stage process is stopped and
  :class:`StageError` is raised naming the stage and its error (the tail of its log when it
  died without a word);
* a stage lost later (it exits, reports :class:`StageFailed`, or stops sending heartbeats)
  is supervised (:mod:`vllm_kvbridge.pipeline.supervision`): the requests in it fail at once
  naming it, the others go on, and it is restarted with backoff; once ``max_restarts`` per
  ``restart_window`` are spent, it ends the pipeline as above. The loop checks the
  processes every poll interval, so this takes well under a second, never a hang;
* a request that fails in one stage, or outlives ``runtime.request_timeout``, fails
  alone (the stages are told to abort it);
* :meth:`Pipeline.close` (also on Ctrl-C / exceptions through the context manager) sends
  ``Shutdown``, waits ``runtime.shutdown_timeout``, then SIGTERM and finally SIGKILL to
  each stage's process group, and reaps what dead processes left on the run's edges
  (:func:`~vllm_kvbridge.connectors.leftovers.reap_dead_leftovers`).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from vllm_kvbridge.config.resolve import ResolvedPipeline, resolve
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.admission import check_sampling_params
from vllm_kvbridge.pipeline.control_auth import (
    ControlPlane,
    Received,
    StageUnreachable,
    given_to_sender,
    new_request_id,
)
from vllm_kvbridge.pipeline.placement import StageBackend, make_backend, place_stages, with_run_scope
from vllm_kvbridge.pipeline.replicas import StageReplicas
from vllm_kvbridge.pipeline.request_book import RequestBook
from vllm_kvbridge.pipeline.results import (  # re-exported: the pipeline's public types
    PipelineError,
    RequestError,
    RequestResult,
    StageError,
    StageRecord,
    StageRecovering,
    stage_name,
)
from vllm_kvbridge.pipeline.stage_handles import LOG_TAIL_LINES, RunLogDir, RunShm, StageHandle, stop_stages
from vllm_kvbridge.pipeline.supervision import RestartPolicy, heartbeat_interval, producer_lost_notices

POLL_S = 0.05


class Pipeline:
    """A running multi-stage pipeline (see the module docstring for the contract).

    Stage logs go to ``log_dir/stage_<id>.log``. Without ``log_dir`` the run makes a
    temporary directory at :meth:`start` (``log_dir`` is None until then), removed at
    :meth:`close` after a clean run and kept (its path is reported) when a stage failed or
    was lost or a request failed.

    Use as a context manager, or call :meth:`close`::

        with Pipeline.from_config("stage_configs/ar_to_dit_shm.yaml") as pipe:
            results = pipe.generate(["A cute cat"])
    """

    def __init__(
        self,
        plan: ResolvedPipeline,
        *,
        log_dir: str | Path | None = None,
        progress: Callable[[str], None] | None = None,
        env: Mapping[str, str] | None = None,
        ray_address: str | None = None,
    ) -> None:
        self.run_id = f"r{uuid.uuid4().hex[:10]}"
        # Edges left ``auto`` are bound (and scoped) in start(), once the stages are placed.
        self.plan = with_run_scope(plan, self.run_id)
        self._ray_address = ray_address
        self._backend: StageBackend | None = None
        self._logs = RunLogDir(log_dir, self.run_id)  # its own one goes with a clean run
        self.log_dir = self._logs.path  # made at start() when the run makes its own
        self._progress = progress or (lambda line: None)
        self._env = dict(env or {})
        self._shm: RunShm | None = None
        self._control: ControlPlane | None = None
        self._order = [s.stage_id for s in self.plan.stages]
        self._requests = RequestBook()
        self._started = False
        self._serving = False  # every stage was ready once: losses are supervised from now
        self._closed = False
        plan = self.plan
        self.policy = RestartPolicy(
            plan.max_restarts, plan.restart_window, plan.restart_backoff, plan.heartbeat_timeout
        )
        # One per stage: its replicas' processes and supervision, and the routing between them.
        self._stages = {s.stage_id: StageReplicas(s, self.policy) for s in plan.stages}
        self._by_key: dict[str, StageHandle] = {}  # control key -> the process it was issued for
        self.failure: StageError | None = None

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, path: str | Path, *, model: str | None = None, **kwargs: Any) -> Pipeline:
        """Load and resolve a YAML stage config; ``model`` fills LLM stages that name none."""
        plan = resolve(path)
        if model is not None:
            plan = plan.with_model(str(model))
        missing = [s.stage_id for s in plan.stages if s.is_llm and not s.model and s.url is None]
        if missing:
            raise PipelineError(
                f"no model for LLM stage(s) {missing}: set 'model' in the config or pass model="
            )
        return cls(plan, **kwargs)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Spawn every stage and wait until all are ready (or raise :class:`StageError`)."""
        if self._closed:
            raise PipelineError("pipeline is closed")
        if self._started:
            return
        self._started = True
        self.log_dir = self._logs.ensure()
        # The run id names everything the run puts in /dev/shm (kvbridge.<run id>-...): said
        # first, so an operator (or a test) can tell this run's names from another's.
        self._progress(f"run {self.run_id}: stage logs in {self.log_dir}")
        self._shm = RunShm(self.run_id, self._env)  # reaps dead runs' leftovers now
        try:
            self._backend = backend = make_backend(self.plan, self.run_id, self._ray_address)
            self.plan = place_stages(self.plan, backend, self.run_id, self._progress)
            plan = self.plan
            self._stages = {
                s.stage_id: StageReplicas(s, self.policy, plan.copies(s.stage_id)) for s in plan.stages
            }
            self._control = ControlPlane(backend.control_host())
            for reps in self._stages.values():
                for k in range(len(reps)):
                    self._spawn(reps, k)
            self._wait_ready()
            self._shm.started()
            self._serving = True
        except BaseException:
            self.close()
            raise

    def _handles(self) -> list[StageHandle]:
        """The current process of every replica of every stage spawned so far."""
        return [h for reps in self._stages.values() for _, h in reps.live()]

    def _spawn(self, reps: StageReplicas, k: int) -> None:
        stage = reps.copies[k]
        log_path = self.log_dir / reps.log_name(k)
        assert self._backend is not None and self._control is not None
        creds = self._control.issue(stage.stage_id)  # a key per process: a successor gets its own
        env, beat = creds.in_env(self._env), heartbeat_interval(self.policy)
        handle = self._backend.spawn(stage, self._control.address, log_path, env, beat)
        handle.control_key, handle.route = creds.public, creds.route.encode()
        reps.handles[k] = self._by_key[creds.public] = handle
        node = handle.proc.node
        where = "" if node.node_id == "local" else f" on node {node.node_id[:12]} ({node.ip})"
        self._progress(f"[{handle.label}] starting{where} (pid {handle.proc.pid}, log {handle.proc.log})")

    def _wait_ready(self) -> None:
        # A stage not ready within its start_timeout fails the start (StageSupervision.check).
        while not all(reps.ready for reps in self._stages.values()):
            self._pump(POLL_S)

    def close(self) -> None:
        """Stop every stage process and release sockets and segments. Idempotent."""
        if self._closed:
            return
        self._closed = True
        control = self._control

        def shutdown(h: StageHandle) -> None:
            if control is not None:
                with contextlib.suppress(zmq.ZMQError, StageUnreachable):
                    control.send(h.route, m.Shutdown(), block=False)

        stop_stages(self._handles(), shutdown, self.plan.shutdown_timeout)
        if self._backend is not None:
            self._backend.reap([c for s in self.plan.stages for c in self.plan.copies(s.stage_id)])
            self._backend.close()
        if self._control is not None:
            self._control.close()
        self._control = None
        if self._shm is not None:
            self._shm.close()
        lost = any(h.failure for h in self._handles())
        failed = self.failure or lost or self._requests.failed
        clean = (self._serving or not self._started) and not failed
        if self._logs.close(clean=clean):
            self._progress(f"stage logs kept in {self.log_dir}")

    def __enter__(self) -> Pipeline:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str] | str,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        raise_on_error: bool = True,
    ) -> list[RequestResult]:
        """Run ``prompts`` through every stage (all in flight at once); results in prompt order.

        ``sampling_params`` override the first stage's ``default_sampling_params``. Raises
        :class:`StageError` when a stage dies (the pipeline is then closed) and, with
        ``raise_on_error``, :class:`RequestError` when any request failed.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        check_sampling_params(self.plan, sampling_params)  # before any stage starts
        self.start()
        if self.failure is not None:
            raise self.failure
        book = self._requests
        ids = list(request_ids) if request_ids else book.batch_ids(len(prompts))  # see submit()
        if len(ids) != len(prompts) or len(set(ids)) != len(ids):
            raise ValueError("request_ids must be unique and one per prompt")
        for rid in ids:
            book.check_new(rid)
        try:
            while self.recovering():  # a stage lost in an earlier call: wait for it first
                self._pump(POLL_S)
            for rid, prompt in zip(ids, prompts):
                msg = book.begin(self.plan, rid, prompt, sampling_params, None, None, polled=False)
                self._submit_chain(self.plan.entry_stage.stage_id, msg)
            while not all(book.results[r].finished for r in ids):
                self._pump(POLL_S)
                self._expire()
        except BaseException:
            self.close()
            raise
        results = [book.pop(r) for r in ids]
        if raise_on_error and any(r.error for r in results):
            raise RequestError(results)
        return results

    def _submit(self, stage_id: int, msg: m.Submit) -> int:
        """Hand ``msg`` to the replica of ``stage_id`` that :meth:`StageReplicas.pick` picks
        (or picked ahead: a routed producer's consumer; see pipeline/replicas.py); returns it."""
        reps, book = self._stages[stage_id], self._requests
        k = book.picked(msg.request_id, stage_id)
        k = reps.pick(book.outstanding(stage_id, len(reps))) if k is None else k
        h = reps.handle(k)
        routes = {}
        for b in reps.routed(k):  # its consumer replica now, and the route there
            j = self._stages[b].pick(book.outstanding(b, len(self._stages[b])))
            book.pick(msg.request_id, b, j)
            routes[b] = self.plan.link(stage_id, b, k, j).route  # type: ignore[union-attr]
        msg = msgspec.structs.replace(msg, routes=routes) if routes else msg
        record = StageRecord(stage_id, h.stage.kind, time.time(), node_id=h.proc.node.node_id, replica=k)
        self._requests.entered(msg.request_id, record)
        if stage_id == self._order[-1] and msg.request_id in self._requests.on_progress:
            msg = msgspec.structs.replace(msg, stream=True)
        sup = reps.supervision[k]
        if sup.recovering:  # it waits for the replica (not in it: a further loss spares it)
            sup.pending.append(msg)
            return k
        self._send_submit(h, msg)
        return k

    def _send_submit(self, h: StageHandle, msg: m.Submit) -> None:
        stage_id = h.stage.stage_id
        self._requests.sent(msg.request_id, stage_id)
        assert self._control is not None
        try:
            self._control.send(h.route, msg)
        except StageUnreachable as exc:
            # Lost before we noticed (the supervision check will): this request fails now,
            # as the ones in it will, instead of the error leaving the event loop.
            self._finish(msg.request_id, f"{h.label} is unreachable: {exc}", lost_stage=stage_id)

    def _finish(
        self, rid: str, error: str | None = None, lost_stage: int | None = None, *, aborted: bool = False
    ) -> None:
        book = self._requests
        for sid in book.finish(rid, error, lost_stage, aborted=aborted):
            # a failed request: the stages (their replicas) still working on it drop it
            self._tell(self._stages[sid].handles[book.replica_of(rid, sid) or 0], m.Abort([rid]))

    def _tell(self, h: StageHandle | None, msg: m.Abort | m.ProducerLost) -> None:
        """Send ``msg`` to the process ``h`` unless it is gone (then it has nothing to drop)."""
        if h is None or h.lost or h.proc.poll() is not None or self._control is None or self._closed:
            return
        with contextlib.suppress(zmq.ZMQError, StageUnreachable):
            self._control.send(h.route, msg, block=False)

    def _expire(self) -> None:
        for rid, pending in self._requests.expired(time.monotonic()).items():
            self._finish(rid, f"timed out after {self.plan.request_timeout:.0f} s in stage(s) {pending}")

    # -- the event loop -----------------------------------------------------------------
    def _pump(self, timeout_s: float) -> None:
        """Handle stage messages for up to ``timeout_s`` and check the stage processes."""
        assert self._control is not None
        if self._control.poll(int(timeout_s * 1000)):
            while (got := self._control.receive()) is not None:
                self._handle(got)
        self._check_stages()

    def _check_stages(self) -> None:
        """Notice lost stages (exited, stalled, not ready in time) and spawn due restarts."""
        assert self._control is not None
        now = time.monotonic()
        for reps, k, h in [(r, k, h) for r in self._stages.values() for k, h in r.live()]:
            if self._closed:
                return
            sup = reps.supervision[k]
            if h.lost:
                if sup.due(now):
                    self._spawn(reps, k)
                    sup.restart_at = 0.0
                continue
            if h.proc.poll() is not None:  # its last words first (a StageFailed says why)
                while not h.lost and (got := self._control.receive()) is not None:
                    self._handle(got)
            error = None if h.lost else sup.check(h, now)
            if error is not None:
                self._lose(h, error)

    def _lose(self, h: StageHandle, error: StageError) -> None:
        """``h``'s process is given up: fail the requests in it and restart it, or, with no
        restart left (or while the pipeline starts), fail the pipeline."""
        sid, k = h.stage.stage_id, h.stage.replica
        h.failure, h.lost = error, True
        # Its whole group goes first, also when the pipeline fails with it: the engine core
        # of a killed stage process holds its segments until it is gone, and the reap at
        # close must find them ownerless.
        h.proc.kill_group(h.shm_names)
        if self._control is not None:
            self._control.revoke(h.control_key)
        sup = self._stages[sid].supervision[k]
        delay = sup.lost(error) if self._serving else None
        if delay is None:
            self._fail(sup.exhausted(error) if self._serving else error)
        with contextlib.suppress(subprocess.TimeoutExpired):
            h.proc.wait(timeout=1)  # reap it
        RunShm.reap()  # the queues and semaphores its engine recorded (its lock dropped)
        self._progress(f"[{h.label}] LOST: {error.error}; {sup.plan_line(delay)}")
        # What it handed on may have died with it: its consumers fail what they had not read.
        book = self._requests
        sups = {(c, j): s for c, reps in self._stages.items() for j, s in enumerate(reps.supervision)}
        notices = producer_lost_notices(h.stage, book.results, book.where, sups)
        for (consumer, j), notice in notices.items():
            self._tell(self._stages[consumer].handles[j], notice)
        for rid in book.in_stage(sid, k):
            # What earlier stages handed to the lost one has no consumer any more: the
            # Abort that _finish sends them too makes them withdraw it (no TTL to wait).
            book.where[rid] |= book.done_stages(rid) - {sid}
            self._finish(rid, str(error), lost_stage=sid)

    def _fail(self, error: StageError) -> None:
        reps = self._stages.get(error.stage_id)
        h = reps.handles[error.replica or 0] if reps is not None else None
        if h is not None and h.failure is None:
            h.failure = error
        self.failure = self.failure or error
        self._progress(f"[{stage_name(error.stage_id, error.kind, error.replica)}] FAILED: {error.error}")
        for rid in list(self._requests.deadlines):
            self._finish(rid, str(error))
        self.close()
        raise error

    def _handle(self, got: Received) -> None:
        msg, h = got.msg, self._by_key.get(got.key)
        if h is None or h.lost:
            return  # from a process given up (killed, or already replaced by its successor)
        given = given_to_sender(msg, self._requests.results, h.stage.replica)
        if getattr(msg, "pid", 0) not in (0, h.proc.pid) or not given:
            assert self._control is not None
            self._control.drop(f"{h.label} spoke for another process or of a request not given to it")
            return
        h.last_seen = time.monotonic()
        if isinstance(msg, m.Heartbeat):
            h.stalled_since = h.last_seen - msg.stalled_s if msg.stalled_s > 0 else 0.0
            h.stall = msg.stall
        if isinstance(msg, m.StageStats):
            h.counters = dict(msg.counters)
        if isinstance(msg, m.Heartbeat | m.StageStats):
            return
        if isinstance(msg, m.Ready):
            h.ready_at, h.info = time.monotonic(), msg.info
            h.shm_names = h.proc.mapped_shm()
            self._progress(f"[{h.label}] ready in {h.ready_at - h.spawned:.1f} s")
            sup = self._stages[h.stage.stage_id].supervision[h.stage.replica]
            if sup.recovering:
                self._progress(f"[{h.label}] back after {h.ready_at - sup.lost_at:.1f} s")
                for waiting in sup.recovered():
                    r = self._requests.results.get(waiting.request_id)
                    if r is not None and not r.finished:
                        self._send_submit(h, waiting)
                for notice in sup.notices:  # producers lost while those waited (after them)
                    self._tell(h, notice)
                sup.notices.clear()
        elif isinstance(msg, m.StageFailed):
            tail = msg.traceback.strip().splitlines()
            self._lose(h, h.error(msg.error, "\n".join(tail[-LOG_TAIL_LINES:])))
        elif isinstance(msg, m.RequestFailed):
            self._progress(f"[{h.label}] {msg.request_id} failed: {msg.error}")
            error = f"{h.label}: {msg.error}"
            self._finish(msg.request_id, error, lost_stage=msg.lost_stage)
        elif isinstance(msg, m.StageProgress):
            callback = self._requests.on_progress.get(msg.request_id)
            # None: a request that finished already (aborted, timed out) or does not stream.
            if callback is not None:
                callback(msg)
        elif isinstance(msg, m.StageDone):
            self._on_done(h, msg)

    def _on_done(self, h: StageHandle, msg: m.StageDone) -> None:
        rid, idx, book = msg.request_id, self._order.index(msg.stage_id), self._requests
        rec = book.stage_done(msg, last=idx + 1 == len(self._order))
        if rec is None:
            return  # late answer for a request that already failed or timed out
        self._progress(f"[{h.label}] {rid} done in {rec.wall_s:.2f} s")
        if idx + 1 < len(self._order) and not book.entered_stage(rid, nxt := self._order[idx + 1]):
            up = m.Upstream(
                msg.stage_id, msg.transfer_request_id or rid, msg.sender_info, msg.output, h.stage.replica
            )
            self._submit(nxt, book.downstream_submit(self._stages[nxt].stage, rid, [up]))
        if book.all_done(rid, len(self._order)):
            self._finish(rid)

    def _submit_chain(self, stage_id: int, msg: m.Submit) -> None:
        """Submit to ``stage_id``, and at once to the stages behind async-chunk edges: they
        start receiving chunks while the producer is still generating. The consumer's
        replica is picked here, once: the whole stream goes to it (sticky)."""
        k = self._submit(stage_id, msg)
        reps = self._stages[stage_id]
        up_front = reps.handle(k).info.get("sender_info") or {}  # that replica's, reported at Ready
        for e in reps.stage.outputs:
            if e.payload_mode == "async_chunk":
                up = m.Upstream(stage_id, msg.request_id, up_front, {}, k)
                nxt = self._requests.downstream_submit(self._stages[e.to_stage].stage, msg.request_id, [up])
                self._submit_chain(e.to_stage, nxt)

    # -- concurrent submission (driven by one thread; see pipeline/service.py) -----------
    def submit(
        self,
        prompt: str,
        sampling_params: Mapping[str, Any] | None = None,
        *,
        request_id: str | None = None,
        stage_params: Mapping[int, Mapping[str, Any]] | None = None,
        on_progress: Callable[[m.StageProgress], None] | None = None,
    ) -> str:
        """Start one request without waiting for it; returns its id.

        ``sampling_params`` override the first stage's defaults, ``stage_params`` (stage id ->
        params) those of any stage (e.g. a diffusion stage's ``seed`` / ``num_steps``).
        ``on_progress`` streams the request: it is called (from :meth:`poll`, in order) with
        every :class:`~vllm_kvbridge.pipeline.messages.StageProgress` of the last stage until
        the request finishes; its deltas concatenate to a prefix of the result's
        ``text`` / ``token_ids`` (an LLM last stage reports all of it; a diffusion or
        external last stage reports none). It must be quick; an exception it raises
        propagates out of :meth:`poll`.

        The request progresses while :meth:`poll` runs; :meth:`poll` returns it once it
        finished (successfully or with ``error``). Not thread-safe: ``submit``, ``poll``
        and ``abort`` must be called from one thread (:class:`PipelineService` does).
        Raises :class:`StageError` when the pipeline already failed, :class:`PipelineError`
        when it is closed, :class:`StageRecovering` while a lost stage is restarted (nothing
        was started), ``ValueError`` for a duplicate id (also one that ended in error less
        than ``ABORTED_KEEP_S`` ago) or parameters a stage cannot honour
        (:func:`~vllm_kvbridge.pipeline.admission.check_sampling_params`).
        """
        check_sampling_params(self.plan, sampling_params, stage_params)  # before any stage starts
        self.start()
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise PipelineError("pipeline is closed")
        lost = self.recovering()
        if lost:
            raise StageRecovering(lost[0])
        if request_id is None:  # served requests: an id nobody can guess (control_auth)
            request_id = new_request_id()
        book = self._requests
        book.check_new(request_id)
        msg = book.begin(
            self.plan, request_id, prompt, sampling_params, stage_params, on_progress, polled=True
        )
        self._submit_chain(self.plan.entry_stage.stage_id, msg)
        return request_id

    def poll(self, timeout_s: float = POLL_S) -> list[RequestResult]:
        """Make progress for up to ``timeout_s``; return (and forget) the requests started
        with :meth:`submit` that finished. Raises :class:`StageError` when a stage died
        (the pipeline is then closed; every in-flight request is finished with the error)."""
        if self._closed and self.failure is None:
            raise PipelineError("pipeline is closed")
        try:
            if self.failure is None:
                self._pump(timeout_s)
                self._expire()
        finally:
            self._requests.collect_polled()
        return self.take_finished()

    def take_finished(self) -> list[RequestResult]:
        """Results :meth:`poll` collected before it raised (a stage died mid-poll)."""
        return self._requests.take_finished()

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Finish ``request_id`` with error ``reason`` and tell every stage working on it
        to drop it (its KV, payload keys and blocks are released there). False when the
        request is unknown or already finished."""
        r = self._requests.results.get(request_id)
        if r is None or r.finished:
            return False
        self._finish(request_id, reason, aborted=True)
        return True

    def in_flight(self) -> list[str]:
        """Ids of requests not finished yet."""
        return self._requests.in_flight()

    def request_stages(self) -> dict[str, list[int]]:
        """Request id -> the stages working on it now. Safe from another thread (for
        ``/debug/state``): a round that meets the pump thread's changes is retried."""
        return self._requests.request_stages()

    def request_replicas(self) -> dict[str, dict[int, int]]:
        """Request id -> {stage id: the replica it was routed to} of the requests in flight.
        Safe from another thread (``/debug/state``), like :meth:`request_stages`."""
        return self._requests.request_replicas()

    def recovering(self) -> list[StageError]:
        """Why each stage that cannot take a request now was lost: every replica of it is
        being restarted (empty while each stage has a replica up)."""
        return [e for reps in self._stages.values() if (e := reps.recovering_error()) is not None]

    def stage_health(self) -> list[dict[str, Any]]:
        """Per stage, see :meth:`StageReplicas.health` (every replica's state under ``replicas``)."""
        failed = self.failure is not None
        return [self._stages[s.stage_id].health(failed) for s in self.plan.stages]

    # -- introspection ------------------------------------------------------------------
    @property
    def control_address(self) -> str:
        """Where the stages reach the orchestrator ("" until :meth:`start`); it admits only them."""
        return self._control.address if self._control is not None else ""

    def control_counters(self) -> dict[str, int]:
        """``ControlPlane.counters`` (zeros before :meth:`start`, after :meth:`close`); any thread."""
        control = self._control
        return control.counters() if control is not None else dict.fromkeys(ControlPlane.COUNTERS, 0)

    def stage_pids(self) -> dict[int, int]:
        """Stage id -> the pid of its (first replica's) process."""
        return {sid: reps.handle(0).proc.pid for sid, reps in self._stages.items() if reps.handles[0]}

    def replica_pids(self) -> dict[tuple[int, int], int]:
        """(stage id, replica) -> the pid of that replica's process now."""
        return {(sid, k): h.proc.pid for sid, reps in self._stages.items() for k, h in reps.live()}
