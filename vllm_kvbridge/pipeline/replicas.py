"""The replica set of one stage: its processes, their supervision, and where a request goes.

A stage with ``replicas: N`` (``StageSpec.replicas``, issue 41) runs as N independent
copies, each its own stage process (its own engine, TP group and share of ``devices``:
:meth:`~vllm_kvbridge.config.resolve.ResolvedStage.for_replica`), started, supervised and
restarted on its own. :class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` keeps one
:class:`StageReplicas` per stage (N = 1 for most: then everything is as it was without
replicas) and asks it, per request and stage, which replica takes the request
(:meth:`StageReplicas.pick`): the one with the least outstanding work (requests dispatched
to it and not reported done: ``RequestBook.outstanding``) among those that are up, ties to
the lowest index, so a run is reproducible. While every replica of a stage recovers, the
request waits for the least loaded one, as it waits for a recovering stage without replicas.

What follows from routing a request once per stage:

* an async-chunk stream is sticky: its consumer's replica is picked when the request is
  submitted to the consumer (at once, with its producer: ``Pipeline._submit_chain``), and a
  request is submitted to a stage once, so the whole stream lands on that replica;
* CFG companions travel in their primary's ``Submit`` (``Submit.companions``), so they go
  where it goes;
* keys stay unambiguous: a transfer's key names its request and edge
  (:mod:`vllm_kvbridge.connectors.keys`), a request is in one replica of a stage at a time,
  and its consumer reads with the sender info of the producer replica that made it (named
  in ``Upstream.replica``), so every producer replica can send to every consumer replica
  over the edge's connector;
* through Ray the connector is picked per pair of replicas (``config/locality.py``): a
  producer replica with consumer replicas on its node and on others holds both (its end is
  routed: ``connectors/routed.py``). Its data must go over the pair's, so the consumer
  replica of a request is picked when the request is submitted to that producer
  (:meth:`StageReplicas.routed`, ``RequestBook.pick``; it counts as that replica's load
  from then on) and the producer is told the route (``Submit.routes``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from vllm_kvbridge.config.locality import ROUTED
from vllm_kvbridge.config.resolve import ResolvedStage
from vllm_kvbridge.pipeline.results import StageError
from vllm_kvbridge.pipeline.stage_handles import StageHandle
from vllm_kvbridge.pipeline.supervision import RestartPolicy, StageSupervision, stage_status

__all__ = ["StageReplicas"]


class StageReplicas:
    """The processes of one stage (one per replica) and their supervision."""

    def __init__(
        self, stage: ResolvedStage, policy: RestartPolicy, copies: Sequence[ResolvedStage] | None = None
    ) -> None:
        self.stage = stage
        #: what each replica's process is started with (again after a loss): the placed
        #: plan's copies (``ResolvedPipeline.copies``), else ``for_replica``'s
        self.copies = (
            list(copies) if copies is not None else [stage.for_replica(k) for k in range(stage.replicas)]
        )
        #: the current process of each replica (None until it is first spawned)
        self.handles: list[StageHandle | None] = [None] * stage.replicas
        self.supervision = [StageSupervision(policy) for _ in self.copies]

    def __len__(self) -> int:
        return len(self.copies)

    def live(self) -> Iterator[tuple[int, StageHandle]]:
        """(replica, its current process) for every replica spawned so far."""
        for k, h in enumerate(self.handles):
            if h is not None:
                yield k, h

    def handle(self, k: int) -> StageHandle:
        h = self.handles[k]
        if h is None:
            raise RuntimeError(f"stage {self.stage.stage_id} replica {k} was never started")
        return h

    def log_name(self, k: int) -> str:
        """Its log's file name: ``stage_<id>.log``, ``stage_<id>.replica<k>.log`` with replicas."""
        sid = self.stage.stage_id
        return f"stage_{sid}.log" if len(self) == 1 else f"stage_{sid}.replica{k}.log"

    @property
    def ready(self) -> bool:
        return all(h is not None and h.ready_at for h in self.handles)

    def pick(self, load: Sequence[int]) -> int:
        """The replica for a new request, given each replica's outstanding requests: the
        least loaded one that is not recovering (any, when all are), lowest index first."""
        up = [k for k, sup in enumerate(self.supervision) if not sup.recovering]
        return min(up or range(len(self)), key=lambda k: (load[k], k))

    def routed(self, k: int) -> list[int]:
        """The consumer stages replica ``k`` sends to over a routed end: a request's consumer
        replica there is picked when the request is submitted to ``k``."""
        return [e.to_stage for e in self.copies[k].outputs if e.connector.name == ROUTED]

    def recovering_error(self) -> StageError | None:
        """Why the stage cannot take a request now: every replica is being restarted (the
        last one lost's error); None while one is up."""
        if not all(sup.recovering for sup in self.supervision):
            return None
        last = max(self.supervision, key=lambda sup: sup.lost_at)
        return last.last_error

    def health(self, pipeline_failed: bool) -> dict[str, Any]:
        """The stage's ``/health`` entry (:func:`~vllm_kvbridge.pipeline.supervision.stage_status`).
        With replicas: ``status`` is ``ready`` while one replica is, ``recovering`` while none
        is and one recovers, else replica 0's; ``restarts`` and ``counters`` are summed, and
        ``replicas`` lists each replica's own entry (with ``replica``: its index)."""
        entries = [
            stage_status(copy, h, sup, pipeline_failed)
            for copy, h, sup in zip(self.copies, self.handles, self.supervision)
        ]
        if len(entries) == 1:
            return entries[0]
        for k, e in enumerate(entries):
            e["replica"] = k
        statuses = [e["status"] for e in entries]
        status = "ready" if "ready" in statuses else "recovering" if "recovering" in statuses else statuses[0]
        counters: dict[str, float] = {}
        for e in entries:
            for name, value in e.get("counters", {}).items():
                counters[name] = counters.get(name, 0) + value
        entry: dict[str, Any] = {
            "stage_id": self.stage.stage_id,
            "kind": self.stage.kind,
            "status": status,
            "restarts": sum(e["restarts"] for e in entries),
            "replicas": entries,
        }
        if counters:
            entry["counters"] = counters
        return entry
