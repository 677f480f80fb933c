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
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import msgspec

from vllm_kvbridge.config.gpu_pairing import pair_cuda_ipc_devices
from vllm_kvbridge.config.resolve import AUTO_CONNECTOR as AUTO
from vllm_kvbridge.config.resolve import ResolvedConnector, ResolvedPipeline, ResolvedStage


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


def bind_auto_edges(plan: ResolvedPipeline, nodes: dict[int, NodeInfo]) -> ResolvedPipeline:
    """``plan`` with every auto edge bound to a connector for where its stages run."""
    chosen: dict[tuple[int, int], ResolvedConnector] = {}
    for a, b in auto_edges(plan):
        na, nb = nodes[a], nodes[b]
        if na.shares_memory_with(nb):
            c = plan.same_node_connector
            why = f"auto: stages {a} and {b} on one node ({_short(na.node_id)}, one /dev/shm)"
            chosen[(a, b)] = msgspec.structs.replace(c, reason=why)
        else:
            c = plan.cross_node_connector
            config = dict(c.config)
            if c.name == "ZmqConnector" and "host" not in config:
                config["host"] = na.ip  # the sender serves; its receiver reads the endpoint
            why = (
                f"auto: stage {a} on node {_short(na.node_id)} ({na.ip}), stage {b} on node"
                f" {_short(nb.node_id)} ({nb.ip})"
            )
            chosen[(a, b)] = msgspec.structs.replace(c, config=config, reason=why)
    if not chosen:
        return plan

    def bind(s: ResolvedStage) -> ResolvedStage:
        def fix(edges):  # type: ignore[no-untyped-def]
            return [
                msgspec.structs.replace(e, connector=chosen[(e.from_stage, e.to_stage)])
                if e.connector.name == AUTO
                else e
                for e in edges
            ]

        return msgspec.structs.replace(s, inputs=fix(s.inputs), outputs=fix(s.outputs))

    # An auto edge may become CUDA IPC (runtime.same_node_connector): pair its stages' GPUs.
    return msgspec.structs.replace(plan, stages=pair_cuda_ipc_devices([bind(s) for s in plan.stages]))


def _short(node_id: str) -> str:
    return node_id[:12]
