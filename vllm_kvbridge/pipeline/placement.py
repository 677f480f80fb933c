"""Where a pipeline's stages run: the backends the orchestrator spawns stages through.

A backend places the stages (:meth:`place`: each replica's :class:`NodeInfo`, which decides
its ``connector: auto`` edges, pair by pair), says where the control socket must listen for the stages to
reach it (:meth:`control_host`), starts a stage's process (:meth:`spawn`) and releases what it
holds once every stage stopped (:meth:`close`). :class:`LocalBackend` (the default) runs every
stage as a child process of the orchestrator; the Ray backend
(:mod:`vllm_kvbridge.pipeline.ray_backend`) runs each in a Ray actor on the node Ray picks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from vllm_kvbridge.config.locality import NodeInfo, bind_auto_edges, local_node
from vllm_kvbridge.config.resolve import ResolvedPipeline, ResolvedStage
from vllm_kvbridge.pipeline.stage_handles import (
    StageHandle,
    reap_run_edges,
    spawn_stage,
    with_run_curve_keys,
    with_run_namespaces,
)


class StageBackend(Protocol):
    def control_host(self) -> str:
        """The address the orchestrator's control socket binds (the stages connect to it)."""

    def place(self, stages: Sequence[ResolvedStage]) -> dict[tuple[int, int], NodeInfo]:
        """Reserve where each of ``stages`` (replica copies: ``ResolvedStage.for_replica``)
        runs, by (stage id, replica); raises :class:`StageError` for one that cannot be."""

    def spawn(
        self, stage: ResolvedStage, address: str, log_path: Path, env: Mapping[str, str], heartbeat_s: float
    ) -> StageHandle:
        """Start ``stage``'s process where it was placed (again, after a loss)."""

    def reap(self, stages: Sequence[ResolvedStage]) -> None:
        """Remove what the stopped stages' processes left on the run's edges, on every node."""

    def close(self) -> None:
        """Release every placement (after the stages stopped). Idempotent."""


class LocalBackend:
    """Every stage a child process of the orchestrator on this host, over loopback."""

    def control_host(self) -> str:
        return "127.0.0.1"

    def place(self, stages: Sequence[ResolvedStage]) -> dict[tuple[int, int], NodeInfo]:
        node = local_node()
        return {(s.stage_id, s.replica): node for s in stages}

    def spawn(
        self, stage: ResolvedStage, address: str, log_path: Path, env: Mapping[str, str], heartbeat_s: float
    ) -> StageHandle:
        return spawn_stage(stage, address, log_path, {**os.environ, **env}, heartbeat_s)

    def reap(self, stages: Sequence[ResolvedStage]) -> None:
        reap_run_edges(stages)

    def close(self) -> None:
        pass


def make_backend(plan: ResolvedPipeline, run_id: str, ray_address: str | None = None) -> StageBackend:
    """The backend ``plan`` asks for (``ray_address`` overrides the config's and selects Ray)."""
    if ray_address is None and plan.backend != "ray":
        return LocalBackend()
    from vllm_kvbridge.pipeline.ray_backend import RayBackend

    return RayBackend(ray_address or plan.ray_address or "auto", run_id)


def place_stages(
    plan: ResolvedPipeline, backend: StageBackend, run_id: str, progress: Callable[[str], None]
) -> ResolvedPipeline:
    """Place every replica of ``plan``'s stages, bind their ``auto`` edges pair by pair to
    what the placement allows (each choice reported through ``progress``), and give the
    run's edges their own namespaces and CURVE keys (:func:`with_run_scope`): the plan the
    stages are started with (``plan.copies``: each replica's)."""
    external = frozenset(s.stage_id for s in plan.stages if s.url is not None)
    nodes: dict[Any, NodeInfo] = dict(
        backend.place([c for s in plan.stages if s.url is None for c in plan.copies(s.stage_id)])
    )
    nodes.update({sid: local_node() for sid in external})  # a server the config points at
    plan = bind_auto_edges(plan, nodes)
    for s in plan.stages:
        for e in s.outputs:
            why = f" ({e.connector.reason})" if e.connector.reason else ""
            progress(f"[edge {e.from_stage}->{e.to_stage}] {e.connector.name}{why}")
    for x in plan.links:
        if plan.stage(x.from_stage).replicas > 1 or plan.stage(x.to_stage).replicas > 1:
            progress(
                f"[edge {x.from_stage}->{x.to_stage} replica {x.from_replica}->{x.to_replica}] "
                f"{x.connector.name} ({x.connector.reason})"
            )
    return with_run_scope(plan, run_id)


def with_run_scope(plan: ResolvedPipeline, run_id: str) -> ResolvedPipeline:
    """``plan`` whose shared-memory and Mooncake-store edges have this run's namespace and
    whose ZMQ edges bound beyond loopback have this run's CURVE keys (edges that have
    theirs, or touch a server the config points at, are left as they are: so it can be
    applied again once the ``auto`` edges are bound), the replicas' copies with them (one
    keypair per edge for all of them)."""
    external = frozenset(s.stage_id for s in plan.stages if s.url is not None)
    copies = [(sid, c) for sid, cs in plan.replica_stages.items() for c in cs]
    stages = [with_run_namespaces(s, run_id, external) for s in [*plan.stages, *(c for _, c in copies)]]
    stages = with_run_curve_keys(stages, external)
    n = len(plan.stages)
    replica_stages: dict[int, list[ResolvedStage]] = {sid: [] for sid in plan.replica_stages}
    for (sid, _), scoped in zip(copies, stages[n:]):
        replica_stages[sid].append(scoped)
    return msgspec.structs.replace(plan, stages=stages[:n], replica_stages=replica_stages)
