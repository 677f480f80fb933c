"""The orchestrator: one process per stage, requests routed stage to stage.

``Pipeline`` starts every stage as ``python -m vllm_kvbridge.pipeline.stage_process`` in
its own session, hands it its :class:`ResolvedStage` as JSON on stdin, and talks to it
over one ZMQ ROUTER socket (msgspec messages, see :mod:`vllm_kvbridge.pipeline.messages`).
A request enters the first stage; when a stage reports it done, the sender info it
reported is forwarded with the request to the next stage; the last stage's output is
the request's result. Any number of requests are in flight at once. A request submitted
with ``on_progress`` streams: its last stage is asked to report partial output
(``Submit.stream``) and every :class:`~vllm_kvbridge.pipeline.messages.StageProgress` it
sends is handed to the callback, in order, before the request finishes.

Failure and shutdown contract:

* a stage that reports :class:`StageFailed`, or whose process exits, ends the pipeline:
  every stage process is stopped and :class:`StageError` is raised naming the stage and
  its error (the tail of its log when it died without a word). The loop checks the
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
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from vllm_kvbridge.config.resolve import ResolvedPipeline, ResolvedStage, resolve
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.admission import check_sampling_params
from vllm_kvbridge.pipeline.cfg import check_request_id, companions_for
from vllm_kvbridge.pipeline.engines import ABORTED_KEEP_S, ExpiringIds
from vllm_kvbridge.pipeline.results import (  # re-exported: the pipeline's public types
    PipelineError,
    RequestError,
    RequestResult,
    StageError,
    StageRecord,
)
from vllm_kvbridge.pipeline.stage_handles import (
    LOG_TAIL_LINES,
    StageHandle,
    last_error_line,
    log_tail,
    with_run_curve_keys,
    with_run_namespaces,
)

POLL_S = 0.05


class Pipeline:
    """A running multi-stage pipeline (see the module docstring for the contract).

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
    ) -> None:
        self.run_id = f"r{uuid.uuid4().hex[:10]}"
        external = frozenset(s.stage_id for s in plan.stages if s.url is not None)
        stages = [with_run_namespaces(s, self.run_id, external) for s in plan.stages]
        self.plan = msgspec.structs.replace(plan, stages=with_run_curve_keys(stages, external))
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"kvbridge-{self.run_id}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._progress = progress or (lambda line: None)
        self._env = dict(env or {})
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._stages: dict[int, StageHandle] = {}
        self._order = [s.stage_id for s in self.plan.stages]
        self._results: dict[str, RequestResult] = {}
        self._deadlines: dict[str, float] = {}
        self._where: dict[str, set[int]] = {}  # request id -> stages working on it
        # Ids of requests that ended in error: the stages drop their late output and
        # withdraw their late KV for a while, so such an id is not reused meanwhile.
        self._ended_in_error = ExpiringIds(keep_s=ABORTED_KEEP_S)
        self._counter = 0
        self._stage_params: dict[str, dict[int, dict[str, Any]]] = {}
        self._companions: dict[str, dict[str, str]] = {}  # CFG companions (pipeline/cfg.py)
        self._polled: set[str] = set()  # ids started with submit(), returned by poll()
        self._on_progress: dict[str, Callable[[m.StageProgress], None]] = {}  # streaming requests
        self._finished_polled: list[RequestResult] = []
        self._started = False
        self._closed = False
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
        try:
            self._ctx = zmq.Context()
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
            for stage in self.plan.stages:
                self._spawn(stage, address)
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _spawn(self, stage: ResolvedStage, address: str) -> None:
        env = {**os.environ, **self._env, **stage.env}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if stage.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = stage.devices
        log_path = self.log_dir / f"stage_{stage.stage_id}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "vllm_kvbridge.pipeline.stage_process",
                    "--address",
                    address,
                    "--stage-id",
                    str(stage.stage_id),
                ],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: killable as a whole
            )
        assert proc.stdin is not None
        proc.stdin.write(msgspec.json.encode(stage))
        proc.stdin.close()
        handle = StageHandle(stage, proc, log_path, time.monotonic())
        self._stages[stage.stage_id] = handle
        self._progress(f"[{handle.label}] starting (pid {proc.pid}, log {log_path})")

    def _wait_ready(self) -> None:
        while True:
            waiting = [h for h in self._stages.values() if not h.ready_at]
            if not waiting:
                return
            now = time.monotonic()
            for h in waiting:
                if now - h.spawned > h.stage.start_timeout:
                    self._fail(
                        StageError(
                            h.stage.stage_id,
                            h.stage.kind,
                            f"not ready after {h.stage.start_timeout:.0f} s (start_timeout)",
                            log_tail(h.log_path),
                        )
                    )
            self._pump(POLL_S)

    def close(self) -> None:
        """Stop every stage process and release sockets and segments. Idempotent."""
        if self._closed:
            return
        self._closed = True
        handles = list(self._stages.values())
        for h in handles:
            if h.proc.poll() is None and self._sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart(
                        [f"stage-{h.stage.stage_id}".encode(), m.encode(m.Shutdown())], flags=zmq.NOBLOCK
                    )
        deadline = time.monotonic() + self.plan.shutdown_timeout
        self._wait_exit(handles, deadline)
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [h for h in handles if h.proc.poll() is None]
            for h in alive:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(h.proc.pid, sig)
            self._wait_exit(alive, time.monotonic() + grace)
        # The stage is gone; anything left in its group (vLLM engine-core children) goes too.
        for h in handles:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(h.proc.pid, signal.SIGKILL)
        self._sweep_shm()
        if self._sock is not None:
            self._sock.close(0)
        if self._ctx is not None:
            self._ctx.term()
        self._sock = self._ctx = None

    @staticmethod
    def _wait_exit(handles: Sequence[StageHandle], deadline: float) -> None:
        for h in handles:
            with contextlib.suppress(subprocess.TimeoutExpired):
                h.proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def _sweep_shm(self) -> None:
        """Reap what the stopped stages' processes left on every edge of the run."""
        from vllm_kvbridge.connectors.leftovers import reap_dead_leftovers

        reap_dead_leftovers(
            (e.from_stage, e.to_stage, e.connector.name, e.connector.config)
            for s in self.plan.stages
            for e in (*s.inputs, *s.outputs)
        )

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
        ids = list(request_ids) if request_ids is not None else []
        if not ids:
            for _ in prompts:
                self._counter += 1
                ids.append(f"req-{self._counter}")
        if len(ids) != len(prompts) or len(set(ids)) != len(ids):
            raise ValueError("request_ids must be unique and one per prompt")
        first = self.plan.entry_stage
        companions = companions_for(self.plan, None)
        for rid in ids:
            self._check_new_id(rid)
        for rid, prompt in zip(ids, prompts):
            self._results[rid] = RequestResult(rid, prompt)
            self._deadlines[rid] = time.monotonic() + self.plan.request_timeout
            self._companions[rid] = companions
            params = {**first.default_sampling_params, **(sampling_params or {})}
            msg = m.Submit(rid, prompt=prompt, sampling_params=params, companions=companions)
            self._submit_chain(first.stage_id, msg)
        try:
            while not all(self._results[r].finished for r in ids):
                self._pump(POLL_S)
                self._expire()
        except BaseException:
            self.close()
            raise
        results = [self._results.pop(r) for r in ids]
        if raise_on_error and any(r.error for r in results):
            raise RequestError(results)
        return results

    def _check_new_id(self, rid: str) -> None:
        check_request_id(rid)
        if rid in self._results:
            raise ValueError(f"request id {rid!r} is already in use")
        if rid in self._ended_in_error:
            raise ValueError(
                f"request id {rid!r} ended in error less than {ABORTED_KEEP_S:.0f} s ago (its"
                " stages still drop what arrives late for it): retry under a new id"
            )

    def _submit(self, stage_id: int, msg: m.Submit) -> None:
        h = self._stages[stage_id]
        self._results[msg.request_id].stages.append(StageRecord(stage_id, h.stage.kind, time.time()))
        self._where.setdefault(msg.request_id, set()).add(stage_id)
        if stage_id == self._order[-1] and msg.request_id in self._on_progress:
            msg = msgspec.structs.replace(msg, stream=True)
        assert self._sock is not None
        self._sock.send_multipart([f"stage-{stage_id}".encode(), m.encode(msg)])

    def _finish(self, rid: str, error: str | None = None) -> None:
        r = self._results.get(rid)
        if r is None or r.finished:
            return
        r.error, r.finished = error, True
        if error is not None:
            self._ended_in_error.add(rid)
        self._deadlines.pop(rid, None)
        self._stage_params.pop(rid, None)
        self._companions.pop(rid, None)
        self._on_progress.pop(rid, None)
        stages = self._where.pop(rid, set())
        if error is not None and self._sock is not None and not self._closed:
            # Stages still working on it (e.g. a consumer waiting for chunks) drop it.
            for sid in stages:
                h = self._stages.get(sid)
                if h is not None and h.proc.poll() is None:
                    with contextlib.suppress(zmq.ZMQError):
                        self._sock.send_multipart(
                            [f"stage-{sid}".encode(), m.encode(m.Abort([rid]))], flags=zmq.NOBLOCK
                        )

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, deadline in list(self._deadlines.items()):
            if now > deadline:
                r = self._results[rid]
                pending = [x.stage_id for x in r.stages if not x.done]
                self._finish(rid, f"timed out after {self.plan.request_timeout:.0f} s in stage(s) {pending}")

    # -- the event loop -----------------------------------------------------------------
    def _pump(self, timeout_s: float) -> None:
        """Handle stage messages for up to ``timeout_s`` and check the stage processes."""
        assert self._sock is not None
        if self._sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    ident, frame = self._sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(ident, frame)
        for h in self._stages.values():
            code = h.proc.poll()
            if code is not None and not self._closed:
                # Drain what it may have said last (its StageFailed) before reporting.
                while self._sock.poll(0):
                    self._handle(*self._sock.recv_multipart())
                if h.failure is None:
                    tail = log_tail(h.log_path)
                    why = last_error_line(tail) or "no output"
                    self._fail(
                        StageError(
                            h.stage.stage_id, h.stage.kind, f"process exited with status {code} ({why})", tail
                        )
                    )
                self._fail(h.failure)

    def _fail(self, error: StageError | None) -> None:
        assert error is not None
        h = self._stages.get(error.stage_id)
        if h is not None and h.failure is None:
            h.failure = error
        self.failure = self.failure or error
        self._progress(f"[stage {error.stage_id} ({error.kind})] FAILED: {error.error}")
        for rid in list(self._deadlines):
            self._finish(rid, str(error))
        self.close()
        raise error

    def _handle(self, ident: bytes, frame: bytes) -> None:
        try:
            msg = m.decode_from_stage(frame)
        except msgspec.DecodeError as exc:
            raise PipelineError(f"malformed control message from {ident!r}: {exc}") from None
        h = self._stages.get(getattr(msg, "stage_id", -1))
        if h is None:
            raise PipelineError(f"message from unknown stage {ident!r}")
        if isinstance(msg, m.Ready):
            h.ready_at, h.info = time.monotonic(), msg.info
            self._progress(f"[{h.label}] ready in {h.ready_at - h.spawned:.1f} s")
        elif isinstance(msg, m.StageFailed):
            tail = msg.traceback.strip().splitlines()
            h.failure = StageError(msg.stage_id, h.stage.kind, msg.error, "\n".join(tail[-LOG_TAIL_LINES:]))
            self._fail(h.failure)
        elif isinstance(msg, m.RequestFailed):
            self._progress(f"[{h.label}] {msg.request_id} failed: {msg.error}")
            self._finish(msg.request_id, f"stage {msg.stage_id} ({h.stage.kind}): {msg.error}")
        elif isinstance(msg, m.StageProgress):
            callback = self._on_progress.get(msg.request_id)
            # None: a request that finished already (aborted, timed out) or does not stream.
            if callback is not None:
                callback(msg)
        elif isinstance(msg, m.StageDone):
            self._on_done(h, msg)

    def _on_done(self, h: StageHandle, msg: m.StageDone) -> None:
        r = self._results.get(msg.request_id)
        if r is None or r.finished:
            return  # late answer for a request that already failed or timed out
        rec = next(x for x in r.stages if x.stage_id == msg.stage_id)
        rec.done, rec.started, rec.finished, rec.output = time.time(), msg.started, msg.finished, msg.output
        r.transfers.extend(msg.transfers)
        # The stage is done with it: what it sent is the next stage's to consume (or, on an
        # abort, to drop), so a later Abort goes there only. A producer still holding the
        # request (its StageDone not read yet) gets the Abort and withdraws what it sent.
        self._where.get(msg.request_id, set()).discard(msg.stage_id)
        self._progress(f"[{h.label}] {msg.request_id} done in {rec.wall_s:.2f} s")
        idx = self._order.index(msg.stage_id)
        if idx + 1 < len(self._order):
            nxt = self._order[idx + 1]
            if not any(x.stage_id == nxt for x in r.stages):
                up = m.Upstream(
                    msg.stage_id, msg.transfer_request_id or msg.request_id, msg.sender_info, msg.output
                )
                self._submit(nxt, self._downstream_submit(nxt, msg.request_id, [up]))
        else:
            if msg.image is not None:
                r.image = m.tensor_from_msg(msg.image)
            r.text = msg.output.get("text")
            r.token_ids = msg.output.get("token_ids")
        if len(r.stages) == len(self._order) and all(x.done for x in r.stages):
            self._finish(msg.request_id)

    def _downstream_submit(self, stage_id: int, rid: str, upstream: list[m.Upstream]) -> m.Submit:
        params = self._stages[stage_id].stage.default_sampling_params
        extra = self._stage_params.get(rid, {}).get(stage_id, {})
        companions = self._companions.get(rid, {})
        return m.Submit(
            rid, prompt=None, sampling_params={**params, **extra}, upstream=upstream, companions=companions
        )

    def _submit_chain(self, stage_id: int, msg: m.Submit) -> None:
        """Submit to ``stage_id``, and at once to the stages behind async-chunk edges: they
        start receiving chunks while the producer is still generating."""
        self._submit(stage_id, msg)
        stage = self._stages[stage_id].stage
        up_front = self._stages[stage_id].info.get("sender_info") or {}  # reported at Ready
        for e in stage.outputs:
            if e.payload_mode == "async_chunk":
                up = m.Upstream(stage_id, msg.request_id, up_front, {})
                self._submit_chain(e.to_stage, self._downstream_submit(e.to_stage, msg.request_id, [up]))

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
        when it is closed, ``ValueError`` for a duplicate id (also the id of a request that ended in
        error less than ``ABORTED_KEEP_S`` ago) or parameters a stage cannot
        honour (:func:`~vllm_kvbridge.pipeline.admission.check_sampling_params`).
        """
        check_sampling_params(self.plan, sampling_params, stage_params)  # before any stage starts
        self.start()
        if self.failure is not None:
            raise self.failure
        if self._closed:
            raise PipelineError("pipeline is closed")
        if request_id is None:
            self._counter += 1
            request_id = f"req-{self._counter}"
        self._check_new_id(request_id)
        companions = companions_for(self.plan, stage_params)
        first = self.plan.entry_stage
        self._results[request_id] = RequestResult(request_id, prompt)
        self._deadlines[request_id] = time.monotonic() + self.plan.request_timeout
        self._polled.add(request_id)
        if on_progress is not None:
            self._on_progress[request_id] = on_progress
        if stage_params:
            self._stage_params[request_id] = {int(k): dict(v) for k, v in stage_params.items()}
        params = {
            **first.default_sampling_params,
            **self._stage_params.get(request_id, {}).get(first.stage_id, {}),
            **(sampling_params or {}),
        }
        self._companions[request_id] = companions
        msg = m.Submit(request_id, prompt=prompt, sampling_params=params, companions=companions)
        self._submit_chain(first.stage_id, msg)
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
            done = [rid for rid in self._polled if self._results[rid].finished]
            self._finished_polled.extend(self._results.pop(rid) for rid in done)
            self._polled.difference_update(done)
        return self.take_finished()

    def take_finished(self) -> list[RequestResult]:
        """Results :meth:`poll` collected before it raised (a stage died mid-poll)."""
        out, self._finished_polled = self._finished_polled, []
        return out

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Finish ``request_id`` with error ``reason`` and tell every stage working on it
        to drop it (its KV, payload keys and blocks are released there). False when the
        request is unknown or already finished."""
        r = self._results.get(request_id)
        if r is None or r.finished:
            return False
        self._finish(request_id, reason)
        return True

    def in_flight(self) -> list[str]:
        """Ids of requests not finished yet."""
        return [rid for rid, r in self._results.items() if not r.finished]

    def stage_health(self) -> list[dict[str, Any]]:
        """Per stage: id, kind, ``status`` (``starting`` | ``ready`` | ``failed`` | ``stopped``),
        pid and, for a failed stage, its error."""
        out = []
        for stage in self.plan.stages:
            h = self._stages.get(stage.stage_id)
            entry: dict[str, Any] = {"stage_id": stage.stage_id, "kind": stage.kind}
            if h is None:
                entry["status"] = "not_started"
            elif h.failure is not None:
                entry.update(status="failed", pid=h.proc.pid, error=h.failure.error)
            elif h.proc.poll() is not None:
                entry.update(status="stopped", pid=h.proc.pid, error=f"exited with status {h.proc.poll()}")
            else:
                entry.update(status="ready" if h.ready_at else "starting", pid=h.proc.pid)
            out.append(entry)
        return out

    # -- introspection ------------------------------------------------------------------
    def stage_pids(self) -> dict[int, int]:
        return {sid: h.proc.pid for sid, h in self._stages.items()}

    def stage_info(self) -> dict[int, dict[str, Any]]:
        return {sid: dict(h.info) for sid, h in self._stages.items()}

    def startup_seconds(self) -> dict[int, float]:
        return {sid: h.ready_at - h.spawned for sid, h in self._stages.items() if h.ready_at}
