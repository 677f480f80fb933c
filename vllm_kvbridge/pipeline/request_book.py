"""Request bookkeeping: what the orchestrator knows about each request it was given.

:class:`RequestBook` owns, per request: its :class:`~vllm_kvbridge.pipeline.results.RequestResult`
(a record per stage it entered, the transfers reported, the last stage's output), its
deadline, the stages working on it now, its per-stage parameters and CFG companions
(:func:`~vllm_kvbridge.pipeline.cfg.companions_for`), its progress callback when it streams,
and whether it was started with ``Pipeline.submit`` (then ``Pipeline.poll`` hands it back);
besides, the ids that ended in error lately (not reused meanwhile, see
:func:`~vllm_kvbridge.pipeline.admission.check_new_id`). It builds the ``Submit`` a stage gets
for a request but sends nothing and knows no process: the
:class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` does the talking, e.g. tells the stages
that :meth:`RequestBook.finish` returns to drop a failed request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from vllm_kvbridge.config.resolve import ResolvedPipeline, ResolvedStage
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.admission import check_new_id
from vllm_kvbridge.pipeline.cfg import companions_for
from vllm_kvbridge.pipeline.engines import ABORTED_KEEP_S, ExpiringIds
from vllm_kvbridge.pipeline.results import RequestResult, StageRecord

_T = TypeVar("_T")


class RequestBook:
    """The orchestrator's per-request state (see the module docstring). Not thread-safe,
    except :meth:`request_stages`."""

    def __init__(self) -> None:
        self.results: dict[str, RequestResult] = {}
        self.deadlines: dict[str, float] = {}
        self.where: dict[str, set[int]] = {}  # request id -> stages working on it
        # Ids of requests that ended in error: the stages drop their late output and
        # withdraw their late KV for a while, so such an id is not reused meanwhile.
        self.ended_in_error = ExpiringIds(keep_s=ABORTED_KEEP_S)
        self.failed = False  # a request failed (not aborted by its caller): keep the logs
        self.on_progress: dict[str, Callable[[m.StageProgress], None]] = {}  # streaming requests
        self._counter = 0
        self._stage_params: dict[str, dict[int, dict[str, Any]]] = {}
        self._companions: dict[str, dict[str, str]] = {}  # CFG companions (pipeline/cfg.py)
        #: request id -> {stage id: its replica}, picked before the request reaches it (its
        #: producer's routed edge needs it: pipeline/replicas.py), until it is submitted there
        self._picked: dict[str, dict[int, int]] = {}
        self._polled: set[str] = set()  # ids started with submit(), returned by poll()
        self._finished_polled: list[RequestResult] = []

    # -- entering requests ----------------------------------------------------------------
    def batch_ids(self, n: int) -> list[str]:
        """``n`` ids ``req-<k>`` numbered on from the last batch (its logs, dumps, result.json)."""
        ids = [f"req-{self._counter + i}" for i in range(1, n + 1)]
        self._counter += n
        return ids

    def check_new(self, rid: str) -> None:
        """Refuse (``ValueError``) an id in use or that ended in error lately."""
        check_new_id(rid, self.results, self.ended_in_error)

    def begin(
        self,
        plan: ResolvedPipeline,
        rid: str,
        prompt: str,
        sampling_params: Mapping[str, Any] | None,
        stage_params: Mapping[int, Mapping[str, Any]] | None,
        on_progress: Callable[[m.StageProgress], None] | None,
        *,
        polled: bool,
    ) -> m.Submit:
        """Enter a checked, new request; returns its ``Submit`` to the first stage."""
        first = plan.entry_stage
        self.results[rid] = RequestResult(rid, prompt)
        self.deadlines[rid] = time.monotonic() + plan.request_timeout
        if polled:
            self._polled.add(rid)
        if on_progress is not None:
            self.on_progress[rid] = on_progress
        if stage_params:
            self._stage_params[rid] = {int(k): dict(v) for k, v in stage_params.items()}
        params = self._params(rid, first, sampling_params)
        companions = self._companions[rid] = companions_for(plan, stage_params)
        return m.Submit(rid, prompt=prompt, sampling_params=params, companions=companions)

    def downstream_submit(self, stage: ResolvedStage, rid: str, upstream: list[m.Upstream]) -> m.Submit:
        """The ``Submit`` of request ``rid`` to a stage after the first, fed by ``upstream``."""
        companions = self._companions.get(rid, {})
        params = self._params(rid, stage)
        return m.Submit(rid, prompt=None, sampling_params=params, upstream=upstream, companions=companions)

    def _params(self, rid: str, stage: ResolvedStage, own: Mapping[str, Any] | None = None) -> dict[str, Any]:
        # The stage's defaults, under the request's stage_params for it, under (first stage
        # only) the request's own sampling_params.
        extra = self._stage_params.get(rid, {}).get(stage.stage_id, {})
        return {**stage.default_sampling_params, **extra, **(own or {})}

    def pick(self, rid: str, stage_id: int, replica: int) -> None:
        """Request ``rid`` will go to ``replica`` of ``stage_id`` (it counts there from now)."""
        self._picked.setdefault(rid, {})[stage_id] = replica

    def picked(self, rid: str, stage_id: int) -> int | None:
        """The replica of ``stage_id`` picked for ``rid`` ahead (None: none was)."""
        return self._picked.get(rid, {}).get(stage_id)

    def entered(self, rid: str, record: StageRecord) -> None:
        """Request ``rid`` is submitted to ``record.stage_id`` (maybe still waiting for it)."""
        self.results[rid].stages.append(record)
        self._picked.get(rid, {}).pop(record.stage_id, None)

    def sent(self, rid: str, stage_id: int) -> None:
        """Stage ``stage_id`` works on request ``rid`` now."""
        self.where.setdefault(rid, set()).add(stage_id)

    # -- stages reporting -------------------------------------------------------------------
    def stage_done(self, msg: m.StageDone, last: bool) -> StageRecord | None:
        """Record ``msg`` (and, from the ``last`` stage, the request's output); None for a late
        answer (the request already failed or timed out)."""
        r = self.results.get(msg.request_id)
        if r is None or r.finished:
            return None
        rec = next(x for x in r.stages if x.stage_id == msg.stage_id)
        rec.done, rec.started, rec.finished, rec.output = time.time(), msg.started, msg.finished, msg.output
        rec.first_token_at, rec.last_token_at = msg.first_token_at, msg.last_token_at
        r.transfers.extend(msg.transfers)
        # The stage is done with it: what it sent is the next stage's to consume (or, on an
        # abort, to drop), so a later Abort goes there only. A producer still holding the
        # request (its StageDone not read yet) gets the Abort and withdraws what it sent.
        self.where.get(msg.request_id, set()).discard(msg.stage_id)
        if last:
            if msg.image is not None:
                r.image = m.tensor_from_msg(msg.image)
            if msg.audio is not None:
                r.audio, r.sample_rate = m.tensor_from_msg(msg.audio), msg.output.get("sample_rate")
            r.text = msg.output.get("text")
            r.token_ids = msg.output.get("token_ids")
        return rec

    def entered_stage(self, rid: str, stage_id: int) -> bool:
        """Whether request ``rid`` was submitted to ``stage_id`` already."""
        return any(x.stage_id == stage_id for x in self.results[rid].stages)

    def all_done(self, rid: str, n_stages: int) -> bool:
        """Whether every one of the ``n_stages`` stages reported request ``rid`` done."""
        stages = self.results[rid].stages
        return len(stages) == n_stages and all(x.done for x in stages)

    def in_stage(self, stage_id: int, replica: int = 0) -> list[str]:
        """Requests replica ``replica`` of stage ``stage_id`` works on now."""
        return [
            rid
            for rid, stages in self.where.items()
            if stage_id in stages and self.replica_of(rid, stage_id) == replica
        ]

    def replica_of(self, rid: str, stage_id: int) -> int | None:
        """The replica of stage ``stage_id`` that request ``rid`` was submitted to (None: not yet)."""
        r = self.results.get(rid)
        rec = next((x for x in r.stages if x.stage_id == stage_id), None) if r is not None else None
        return rec.replica if rec is not None else None

    def outstanding(self, stage_id: int, replicas: int) -> list[int]:
        """Per replica of stage ``stage_id``: the requests submitted to it (waiting for it
        included) that it did not report done, of those not finished (the routing load)."""
        load = [0] * replicas
        for r in self.results.values():
            if not r.finished:
                for x in r.stages:
                    if x.stage_id == stage_id and not x.done:
                        load[x.replica] += 1
        for picks in self._picked.values():  # on its way there already
            if stage_id in picks:
                load[picks[stage_id]] += 1
        return load

    def done_stages(self, rid: str) -> set[int]:
        """The stages that reported request ``rid`` done."""
        return {x.stage_id for x in self.results[rid].stages if x.done}

    # -- ending requests --------------------------------------------------------------------
    def finish(
        self, rid: str, error: str | None = None, lost_stage: int | None = None, *, aborted: bool = False
    ) -> set[int]:
        """Finish request ``rid`` (once; later calls do nothing). Returns, when it failed,
        the stages still working on it (e.g. a consumer waiting for chunks): they must be
        told to drop it."""
        r = self.results.get(rid)
        if r is None or r.finished:
            return set()
        r.error, r.finished, r.lost_stage = error, True, lost_stage
        if error is not None:
            self.ended_in_error.add(rid)
            self.failed |= not aborted
        self.deadlines.pop(rid, None)
        self._stage_params.pop(rid, None)
        self._companions.pop(rid, None)
        self._picked.pop(rid, None)
        self.on_progress.pop(rid, None)
        stages = self.where.pop(rid, set())
        return stages if error is not None else set()

    def expired(self, now: float) -> dict[str, list[int]]:
        """Requests past their deadline at ``now`` -> the stages that did not report them done."""
        return {
            rid: [x.stage_id for x in self.results[rid].stages if not x.done]
            for rid, deadline in self.deadlines.items()
            if now > deadline
        }

    def pop(self, rid: str) -> RequestResult:
        """Forget request ``rid``; returns its result."""
        return self.results.pop(rid)

    def collect_polled(self) -> None:
        """Move the finished requests started with ``submit`` to :meth:`take_finished`."""
        done = [rid for rid in self._polled if self.results[rid].finished]
        self._finished_polled.extend(self.results.pop(rid) for rid in done)
        self._polled.difference_update(done)

    def take_finished(self) -> list[RequestResult]:
        """The results :meth:`collect_polled` collected since the last call."""
        out, self._finished_polled = self._finished_polled, []
        return out

    # -- introspection ----------------------------------------------------------------------
    def in_flight(self) -> list[str]:
        """Ids of requests not finished yet."""
        return [rid for rid, r in self.results.items() if not r.finished]

    def request_replicas(self) -> dict[str, dict[int, int]]:
        """Request id -> {stage id: the replica it was routed to} of the requests in flight.
        Safe from another thread, like :meth:`request_stages`."""
        return _read_while_changing(
            lambda: {
                rid: {x.stage_id: x.replica for x in list(r.stages)}
                for rid, r in list(self.results.items())
                if not r.finished
            }
        )

    def request_stages(self) -> dict[str, list[int]]:
        """Request id -> the stages working on it now. Safe from another thread (for
        ``/debug/state``): a round that meets the pump thread's changes is retried."""
        return _read_while_changing(lambda: {rid: sorted(sids) for rid, sids in list(self.where.items())})


def _read_while_changing(read: Callable[[], _T]) -> _T:
    """``read()`` from a thread other than the pump's: a round that meets the pump thread's
    changes (a dict or set changed size while it was read) is retried."""
    while True:
        try:
            return read()
        except RuntimeError:
            continue
