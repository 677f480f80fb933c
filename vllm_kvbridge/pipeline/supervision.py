"""When a lost stage is restarted, and what waits for it meanwhile.

:class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` keeps one :class:`StageSupervision`
per stage. The contract (issue 15, item 1):

* A stage is *lost* when, after the pipeline started, its process exits, it reports
  ``StageFailed``, it sends no heartbeat for ``heartbeat_timeout`` seconds (stopped or
  starved: killed then), its heartbeats say its engine made no progress for
  ``heartbeat_timeout`` seconds (an engine core or worker stopped, deadlocked or wedged:
  :mod:`~vllm_kvbridge.pipeline.liveness`; killed then), or a restart of it is not ready
  within its ``start_timeout``.
* The requests in it fail at once, each with an error naming the stage
  (``RequestResult.lost_stage``); every other stage working on them is told to drop them.
  The other stages keep running.
* It is restarted after ``restart_backoff`` seconds, doubled for each further restart in
  the window (at most :data:`MAX_BACKOFF_S`), unless it was restarted ``max_restarts``
  times within the last ``restart_window`` seconds: then the pipeline fails as it did
  without supervision (:class:`~vllm_kvbridge.pipeline.results.StageError` naming the
  stage, every request failed). ``max_restarts: 0`` turns supervision off.
* While it is *recovering*, requests that reach it from an earlier stage wait for it
  (their ``request_timeout`` still runs) and are handed to it once it is ready.
* Requests it had finished and handed to a consumer stage are not in it any more; their
  consumers are told (``ProducerLost``, :func:`producer_lost_notices`): each fails at once
  those it had not read yet over a connector whose unread data died with its sender
  (``Connector.data_outlives_sender``), naming the lost stage as ``lost_stage``; the rest go
  on. A consumer that is itself recovering is told once it is back, after the submits that
  waited for it.
* A stage that fails while the pipeline starts is not restarted: a stage that cannot start
  is a configuration or environment error, and restarting it would only hide it.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.config.resolve import ResolvedStage
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.results import RequestResult, StageError
from vllm_kvbridge.pipeline.stage_handles import StageHandle

__all__ = [
    "MAX_BACKOFF_S",
    "RestartPolicy",
    "StageSupervision",
    "heartbeat_interval",
    "node_entry",
    "producer_lost_notices",
    "stage_status",
]

#: The longest wait before a restart, however many came before it (seconds).
MAX_BACKOFF_S = 30.0
#: ``/health`` shows a ready stage's engine stall once it is this long (seconds): shorter
#: ones are steps in progress.
STALL_SHOWN_S = 1.0


@dataclass(frozen=True)
class RestartPolicy:
    """``runtime.max_restarts`` / ``restart_window`` / ``restart_backoff`` / ``heartbeat_timeout``."""

    max_restarts: int = 3
    window_s: float = 600.0
    backoff_s: float = 1.0
    heartbeat_timeout_s: float = 30.0


def heartbeat_interval(policy: RestartPolicy) -> float:
    """Seconds between a stage's heartbeats: six per timeout, so a few lost to a busy
    machine never look like a stall."""
    return min(5.0, max(0.05, policy.heartbeat_timeout_s / 6))


@dataclass
class StageSupervision:
    """One stage's restart history and, while it recovers, the submits waiting for it."""

    policy: RestartPolicy
    #: ``time.monotonic()`` of the restarts within the window, oldest first.
    recent: deque[float] = field(default_factory=deque)
    restarts: int = 0  # since the pipeline started
    #: When it was lost (``time.monotonic()``), 0.0 while it is up.
    lost_at: float = 0.0
    #: When its next process is due to be spawned; 0.0 once spawned.
    restart_at: float = 0.0
    last_error: StageError | None = None
    pending: list[m.Submit] = field(default_factory=list)
    #: Producers lost while some of ``pending`` waited: told to the stage after them.
    notices: list[m.ProducerLost] = field(default_factory=list)

    @property
    def recovering(self) -> bool:
        return self.lost_at > 0.0

    def lost(self, error: StageError, now: float | None = None) -> float | None:
        """Record a loss; the seconds to wait before the restart, or None when the budget
        of ``max_restarts`` per window is spent (the pipeline must then fail)."""
        now = time.monotonic() if now is None else now
        self.last_error = error
        while self.recent and now - self.recent[0] > self.policy.window_s:
            self.recent.popleft()
        if len(self.recent) >= self.policy.max_restarts:
            return None
        self.recent.append(now)
        self.restarts += 1
        delay = min(MAX_BACKOFF_S, self.policy.backoff_s * 2 ** (len(self.recent) - 1))
        self.lost_at = self.lost_at or now
        self.restart_at = now + delay
        return delay

    def exhausted(self, error: StageError) -> StageError:
        """The error that ends the pipeline once no restart is left."""
        p = self.policy
        if p.max_restarts == 0:
            why = f"{error.error} (not restarted: runtime.max_restarts is 0)"
        else:
            why = f"{error.error}; not restarted: {len(self.recent)} restart(s) in the last"
            why += f" {p.window_s:.0f} s (runtime.max_restarts: {p.max_restarts})"
        return StageError(error.stage_id, error.kind, why, error.log_tail, error.replica)

    def plan_line(self, delay: float) -> str:
        p = self.policy
        return f"restart {len(self.recent)} of {p.max_restarts} (per {p.window_s:.0f} s) in {delay:.1f} s"

    def check(self, h: StageHandle, now: float) -> StageError | None:
        """Why the live process ``h`` is lost (exited, silent past the heartbeat timeout
        once ready, not ready within ``start_timeout``), or None while it is fine."""
        stage, code = h.stage, h.proc.poll()
        if code is not None:
            if h.failure is not None:
                return h.failure
            tail = h.proc.log_tail()
            why = h.proc.exit_reason(code, tail)
            return h.error(f"process exited with status {code} ({why})", tail)
        timeout = self.policy.heartbeat_timeout_s
        if h.ready_at and now - h.last_seen > timeout:
            silent = f"no heartbeat for {now - h.last_seen:.1f} s (runtime.heartbeat_timeout: {timeout:g} s)"
            return h.error(f"{silent}: stopped or stalled, killed", h.proc.log_tail())
        # A stall is as its beats tell it: once they stop, the rule above decides.
        fresh = now - h.last_seen <= 2 * heartbeat_interval(self.policy)
        if h.ready_at and h.stalled_since and fresh and now - h.stalled_since > timeout:
            error = f"its engine made no progress for {now - h.stalled_since:.1f} s ({h.stall};"
            error += f" runtime.heartbeat_timeout: {timeout:g} s): hung, killed"
            return h.error(error, h.proc.log_tail())
        if not h.ready_at and now - h.spawned > stage.start_timeout:
            return h.error(f"not ready after {stage.start_timeout:.0f} s (start_timeout)", h.proc.log_tail())
        return None

    def due(self, now: float) -> bool:
        """Whether the next process should be spawned now."""
        return self.restart_at > 0.0 and now >= self.restart_at

    def recovered(self) -> list[m.Submit]:
        """The stage is ready again: hand back (and forget) the submits that waited."""
        self.lost_at = self.restart_at = 0.0
        pending, self.pending = self.pending, []
        return pending


def producer_lost_notices(
    lost: ResolvedStage,
    results: Mapping[str, RequestResult],
    where: Mapping[str, set[int]],
    supervision: Mapping[tuple[int, int], StageSupervision],
) -> dict[tuple[int, int], m.ProducerLost]:
    """What to tell each consumer (stage id, replica) of the lost stage process (``lost``:
    the replica it was) now: the unfinished requests that process had finished (its
    ``StageDone`` was read) and handed to that consumer, which may not have read their data
    yet. A recovering consumer's waiting submits from it are queued on its ``notices``
    instead (its process is not there to tell). ``supervision``: per (stage id, replica)."""
    sid, consumers = lost.stage_id, {e.to_stage for e in lost.outputs}
    handed: dict[tuple[int, int], list[str]] = {}
    for rid, stages in where.items():
        r = results.get(rid)
        if r is None or r.finished or sid in stages:
            continue  # requests still in the lost stage fail with it
        if any(x.stage_id == sid and x.replica == lost.replica and x.done for x in r.stages):
            for c in stages & consumers:
                rec = next((x for x in r.stages if x.stage_id == c), None)
                handed.setdefault((c, rec.replica if rec else 0), []).append(rid)
    for (c, _), sup in supervision.items():
        if c not in consumers or not sup.recovering:
            continue
        waiting = [
            p.request_id
            for p in sup.pending
            if any(u.from_stage == sid and u.replica == lost.replica for u in p.upstream)
        ]
        if waiting:
            sup.notices.append(m.ProducerLost(sid, lost.kind, waiting))
    return {c: m.ProducerLost(sid, lost.kind, rids) for c, rids in handed.items()}


def stage_status(
    stage: ResolvedStage, h: StageHandle | None, sup: StageSupervision, pipeline_failed: bool
) -> dict[str, Any]:
    """One stage's health: id, kind, ``status`` (``not_started`` | ``starting`` | ``ready`` |
    ``recovering`` | ``failed`` | ``stopped``), pid, ``node_id``, ``node`` (:func:`node_entry`),
    ``restarts`` so far and, unless it is ready or starting, its error (for ``recovering``: why
    it was lost); ``counters``: its connectors' (``StageStats``) once it reported them."""
    entry: dict[str, Any] = {"stage_id": stage.stage_id, "kind": stage.kind, "restarts": sup.restarts}
    if h is None:
        entry["status"] = "not_started"
    elif sup.recovering and not pipeline_failed and sup.last_error is not None:
        entry.update(status="recovering", pid=h.proc.pid, error=sup.last_error.error)
    elif h.failure is not None:
        entry.update(status="failed", pid=h.proc.pid, error=h.failure.error)
    elif h.proc.poll() is not None:
        entry.update(status="stopped", pid=h.proc.pid, error=f"exited with status {h.proc.poll()}")
    else:
        entry.update(status="ready" if h.ready_at else "starting", pid=h.proc.pid)
    if h is not None:
        entry["node_id"] = h.proc.node.node_id  # a Ray node id; "local" on the local backend
        entry["node"] = node_entry(h)
    if h is not None and h.counters:
        entry["counters"] = dict(h.counters)
    stalled = time.monotonic() - h.stalled_since if h is not None and h.stalled_since else 0.0
    if stalled >= STALL_SHOWN_S and entry["status"] == "ready":  # on its way to the timeout
        entry.update(stalled_s=round(stalled, 1), stall=h.stall)  # type: ignore[union-attr]
    return entry


def node_entry(h: StageHandle) -> dict[str, str]:
    """Where the process ``h`` runs: ``id`` (a Ray node id, ``local`` on the local backend),
    ``ip`` (where other nodes reach it) and ``host``: the host name the process reported at
    ``Ready``; before that, this host's on the local backend, else the node's address."""
    node = h.proc.node
    host = h.info.get("host") or (socket.gethostname() if node.node_id == "local" else node.ip)
    return {"id": node.node_id, "ip": node.ip, "host": str(host)}
