"""``connector: auto``: an edge's connector picked by where its two stages run.

The resolver leaves such an edge as a placeholder (:data:`AUTO`) on both of its ends. Once
the backend has placed the stages (the local backend: every stage on this host; the Ray
backend: wherever Ray put each stage's actor) the pipeline calls :func:`bind_auto_edges`
with each stage's :class:`NodeInfo`: both ends on one node (one Ray node id *and* one
/dev/shm) get ``runtime.same_node_connector`` (shared memory by default), others
``runtime.cross_node_connector`` (ZMQ over TCP by default). A cross-node ZMQ sender that
names no ``host`` binds its node's address, which the receiver learns from the sender
info. Each bound connector says why it was picked (``ResolvedConnector.reason``): the
run's edge table, ``check-config`` and result.json show it.

With replicas (``stages[].replicas``), each replica is placed on its own and the rule
applies per *pair* of replicas (``ResolvedPipeline.links``): through Ray, a DiT replica
beside its producer reads shared memory while one on another node reads TCP. A replica
whose peers on an edge are on both sides holds both connectors, as one
:class:`~vllm_kvbridge.connectors.routed.RoutedConnector` (:data:`ROUTED`), and each
request goes over its pair's (the orchestrator names it: ``pipeline/replicas.py``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_kvbridge.config.gpu_pairing import pair_cuda_ipc_devices
from vllm_kvbridge.config.resolve import AUTO_CONNECTOR as AUTO
from vllm_kvbridge.config.resolve import (
    Link,
    ResolvedConnector,
    ResolvedEdge,
    ResolvedPipeline,
    ResolvedStage,
)
from vllm_kvbridge.errors import ConfigError


@dataclass(frozen=True)
class NodeInfo:
    """Where a stage runs: the node's id (Ray's, or ``local``), an address other nodes reach
    it at, and the identity of its /dev/shm (two Ray nodes of one machine share it)."""

    node_id: str
    ip: str
    shm_id: str

    def shares_memory_with(self, other: NodeInfo) -> bool:
        return self.node_id == other.node_id and self.shm_id == other.shm_id


def shm_identity() -> str:
    """This machine's boot and its /dev/shm mount: equal only where segments are shared."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        st = os.stat("/dev/shm")
        return f"{boot}:{st.st_dev}:{st.st_ino}"
    except OSError:
        return f"{boot}:no-shm"


def local_node() -> NodeInfo:
    """The node of the local backend: every stage on this host, reached over loopback."""
    return NodeInfo("local", "127.0.0.1", shm_identity())


def auto_edges(plan: ResolvedPipeline) -> list[tuple[int, int]]:
    """The (from, to) edges of ``plan`` still waiting for :func:`bind_auto_edges`."""
    return sorted(
        {(e.from_stage, e.to_stage) for s in plan.stages for e in s.outputs if e.connector.name == AUTO}
    )


def describe_auto(plan: ResolvedPipeline) -> str:
    """What an auto edge of ``plan`` becomes (check-config's line, before placement)."""
    same, cross = plan.same_node_connector, plan.cross_node_connector
    where = "this host" if plan.backend == "local" else "placement by Ray"
    return (
        f"auto: {same.name} ('{same.ref}') when both ends share a node, {cross.name} ('{cross.ref}')"
        f" across nodes (backend {plan.backend}: decided at {where})"
    )


NodeKey = int | tuple[int, int]
#: The connector of an edge end whose peer replicas need different connectors
#: (:class:`vllm_kvbridge.connectors.routed.RoutedConnector`), and its routes: ``same`` for
#: peers on this node, ``cross`` for the others.
ROUTED = "RoutedConnector"
SAME, CROSS = "same", "cross"


def routed_config(routes: Mapping[str, tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The config of a routed connector: route -> (connector name, its config)."""
    return {"routes": {r: {"name": name, "config": dict(cfg)} for r, (name, cfg) in routes.items()}}


def bind_auto_edges(plan: ResolvedPipeline, nodes: Mapping[NodeKey, NodeInfo]) -> ResolvedPipeline:
    """``plan`` with every auto edge bound for where its stages run: ``nodes`` gives each
    replica's node (key ``(stage id, replica)``; a stage's one node under its id serves
    all its replicas). Each *pair* of replicas gets its own connector (``plan.links``); a
    replica whose peers on the edge all have one gets it, and one whose peers need both
    gets a :class:`~vllm_kvbridge.connectors.routed.RoutedConnector` of the two (the
    orchestrator names each request's route). ``plan.stages`` hold replica 0's edges;
    ``plan.replica_stages`` every replica's copy."""

    def node(sid: int, k: int) -> NodeInfo:
        return nodes[(sid, k)] if (sid, k) in nodes else nodes[sid]

    links: list[Link] = []
    for a, b in auto_edges(plan):
        for i in range(plan.stage(a).replicas):
            for j in range(plan.stage(b).replicas):
                route, c = _pick(plan, (a, i), (b, j), node(a, i), node(b, j))
                links.append(Link(a, b, i, j, c, route))
    if not links:
        return plan
    copies = {s.stage_id: [_bind_copy(c, links) for c in plan.copies(s.stage_id)] for s in plan.stages}
    # An auto edge may become CUDA IPC (runtime.same_node_connector): pair its stages' GPUs
    # (replicas never do: the resolver refuses it).
    firsts = pair_cuda_ipc_devices([copies[s.stage_id][0] for s in plan.stages])
    stages = [
        msgspec.structs.replace(
            s, inputs=f.inputs, outputs=f.outputs, devices=f.devices if s.replicas == 1 else s.devices
        )
        for s, f in zip(plan.stages, firsts)
    ]
    replica_stages = {s.stage_id: [f, *copies[s.stage_id][1:]] for s, f in zip(plan.stages, firsts)}
    return msgspec.structs.replace(plan, stages=stages, replica_stages=replica_stages, links=links)


def _pick(
    plan: ResolvedPipeline, a: tuple[int, int], b: tuple[int, int], na: NodeInfo, nb: NodeInfo
) -> tuple[str, ResolvedConnector]:
    """The route and connector of one pair of replicas by where they run, and why."""
    sa, sb = _name(plan, *a), _name(plan, *b)
    if na.shares_memory_with(nb):
        why = f"auto: {sa} and {sb} on one node ({_short(na.node_id)}, one /dev/shm)"
        return SAME, msgspec.structs.replace(plan.same_node_connector, reason=why)
    c = plan.cross_node_connector
    config = dict(c.config)
    if c.name == "ZmqConnector" and "host" not in config:
        config["host"] = na.ip  # the sender serves; its receiver reads the endpoint
    why = f"auto: {sa} on node {_short(na.node_id)} ({na.ip}), {sb} on node {_short(nb.node_id)} ({nb.ip})"
    return CROSS, msgspec.structs.replace(c, config=config, reason=why)


def _name(plan: ResolvedPipeline, sid: int, k: int) -> str:
    return f"stage {sid} replica {k}" if plan.stage(sid).replicas > 1 else f"stage {sid}"


def _bind_copy(copy: ResolvedStage, links: list[Link]) -> ResolvedStage:
    """Replica ``copy.replica``'s copy with its auto edges bound to its pairs' connectors."""
    k = copy.replica

    def fix(e: ResolvedEdge) -> ResolvedEdge:
        if e.connector.name != AUTO:
            return e
        sender = e.role == "sender"
        mine = [x for x in links if (x.from_stage, x.to_stage) == (e.from_stage, e.to_stage)]
        pairs = [x for x in mine if (x.from_replica if sender else x.to_replica) == k]
        if len({x.route for x in pairs}) > 1 and e.payload_mode != "none":
            # A payload receiver reaches its sender with what the sender says up front, the
            # same for every request: it cannot tell one route's from the other's yet.
            raise ConfigError(
                f"stage {copy.stage_id} replica {k}: its peers on edge {e.from_stage} -> {e.to_stage} "
                "run on its node and on others, and a payload edge cannot be picked per pair yet "
                "(only KV): give the replicas a placement each so that every replica's peers share "
                "one side, or name the edge's connector"
            )
        return msgspec.structs.replace(e, connector=_one_end(pairs, sender))

    return msgspec.structs.replace(
        copy, inputs=[fix(e) for e in copy.inputs], outputs=[fix(e) for e in copy.outputs]
    )


def _one_end(pairs: list[Link], sender: bool) -> ResolvedConnector:
    """One replica's end of an edge: its pairs' connector, or the routes of both."""
    by_route: dict[str, ResolvedConnector] = {}
    for x in pairs:
        by_route.setdefault(x.route, x.connector)
    if len(by_route) == 1:
        return pairs[0].connector
    peers = ", ".join(
        f"{'replica ' + str(x.to_replica if sender else x.from_replica)}: {x.connector.name}" for x in pairs
    )
    routes = {r: (c.name, c.config) for r, c in sorted(by_route.items(), reverse=True)}
    return ResolvedConnector(AUTO, ROUTED, routed_config(routes), f"auto, per peer replica ({peers})")


def _short(node_id: str) -> str:
    return node_id[:12]
