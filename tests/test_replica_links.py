"""Replicas through Ray (issue 41): each pair of replicas gets the connector its placement
allows, and a replica whose peers are on both sides sends each request over its pair's.

Fast: placement as Ray would report it (no cluster), real shared-memory and ZMQ connectors.
On a real Ray cluster with engines: ``tests/test_ray_pipeline.py::test_dit_replicas_on_two_nodes_*``.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.config.locality import NodeInfo
from vllm_kvbridge.connectors.base import Reservation
from vllm_kvbridge.connectors.keys import kv_key
from vllm_kvbridge.connectors.leftovers import reap_dead_leftovers
from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.connectors.routed import RoutedConnector, RouteTable
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.pipeline.placement import LocalBackend, place_stages
from vllm_kvbridge.pipeline.replicas import StageReplicas
from vllm_kvbridge.pipeline.request_book import RequestBook
from vllm_kvbridge.pipeline.results import StageRecord
from vllm_kvbridge.pipeline.supervision import RestartPolicy
from vllm_kvbridge.wire import encode

A = NodeInfo("node-a", "10.0.0.2", "boot1:1:1")
B = NodeInfo("node-b", "10.0.0.3", "boot2:1:1")
BASE = {
    "runtime": {"backend": "ray"},
    "stages": [
        {"stage_id": 0, "kind": "llm_ar", "kv_transfer": {"need_send_cache": True}},
        {
            "stage_id": 1,
            "kind": "diffusion",
            "kv_transfer": {"need_recv_cache": True},
            "replicas": 2,
            "placement": [{"resources": {"node_a": 0.5}}, {"resources": {"node_b": 1}}],
        },
    ],
}


class Placed(LocalBackend):
    """Where Ray put each replica: the LLM stage and DiT replica 0 on node A, replica 1 on B."""

    def place(self, stages):  # type: ignore[no-untyped-def]
        where = {(0, 0): A, (1, 0): A, (1, 1): B}
        return {(s.stage_id, s.replica): where[(s.stage_id, s.replica)] for s in stages}


def _plan(data=BASE):  # type: ignore[no-untyped-def]
    return resolve_spec(spec_from_dict(copy.deepcopy(data), env={}))


def test_each_pair_of_replicas_gets_the_connector_of_where_they_run() -> None:
    lines: list[str] = []
    plan = place_stages(_plan(), Placed(), "rtest", lines.append)
    pairs = {(x.from_replica, x.to_replica): (x.route, x.connector.name) for x in plan.links}
    assert pairs == {(0, 0): ("same", "SharedMemoryConnector"), (0, 1): ("cross", "ZmqConnector")}
    assert (
        "[edge 0->1 replica 0->0] SharedMemoryConnector (auto: stage 0 and stage 1 replica 0 on one node"
        in ("\n".join(lines))
    )
    assert any(
        line.startswith("[edge 0->1 replica 0->1] ZmqConnector (auto: stage 0 on node node-a")
        for line in lines
    )
    # each DiT replica reads over its one pair's connector, in the run's scope
    dit0, dit1 = plan.copies(1)
    assert (dit0.replica, dit1.replica) == (0, 1)
    shm, tcp = dit0.inputs[0].connector, dit1.inputs[0].connector
    assert shm.name == "SharedMemoryConnector" and shm.config["namespace"] == "rtest-0-1"
    assert tcp.name == "ZmqConnector" and tcp.config["curve_keys_env"].startswith("KVBRIDGE_CURVE_")
    assert dit0.placement == {"resources": {"node_a": 0.5}, "runtime_env": {}}
    assert dit1.placement["resources"] == {"node_b": 1}
    # the LLM stage, with a peer on each side, holds both: its requests say which they take
    [ar] = plan.copies(0)
    send = ar.outputs[0].connector
    assert send.name == "RoutedConnector" and "replica 0: SharedMemoryConnector" in send.reason
    routes = send.config["routes"]
    assert routes["same"] == {"name": "SharedMemoryConnector", "config": shm.config}
    assert routes["cross"]["name"] == "ZmqConnector" and routes["cross"]["config"]["host"] == "10.0.0.2"
    var = routes["cross"]["config"]["curve_keys_env"]
    assert var == tcp.config["curve_keys_env"] and ar.env[var] == dit1.env[var]  # one keypair per edge
    assert StageReplicas(plan.stage(0), RestartPolicy(), plan.copies(0)).routed(0) == [1]
    assert StageReplicas(plan.stage(1), RestartPolicy(), plan.copies(1)).routed(1) == []
    assert plan.link(0, 1, 0, 1).route == "cross" and plan.link(0, 1, 0, 2) is None


def test_a_payload_edge_whose_replica_has_peers_on_both_sides_is_refused_naming_it() -> None:
    data = copy.deepcopy(BASE)
    data["stages"][0].update(kv_transfer={}, payload={"mode": "full", "capture": ["hidden_states"]})
    data["stages"][1] = {
        **data["stages"][1],
        "kind": "llm_ar",
        "kv_transfer": {},
        "payload": {"mode": "full"},
    }
    with pytest.raises(
        ConfigError, match=r"^stage 0 replica 0: its peers on edge 0 -> 1 run on its node and"
    ):
        place_stages(_plan(data), Placed(), "rtest", lambda line: None)


def test_a_consumer_replica_picked_ahead_counts_as_its_load_until_it_is_submitted() -> None:
    plan = _plan()
    book = RequestBook()
    for rid in ("a", "b"):
        book.begin(plan, rid, "p", None, None, None, polled=False)
    book.pick("a", 1, 0)
    assert book.outstanding(1, 2) == [1, 0] and book.picked("a", 1) == 0
    book.entered("a", StageRecord(1, "diffusion", 0.0, replica=0))
    assert book.outstanding(1, 2) == [1, 0] and book.picked("a", 1) is None  # counted once
    book.pick("b", 1, 1)
    book.finish("b", "failed")
    assert book.outstanding(1, 2) == [1, 0]  # a failed request holds nothing


def _kv(n: int) -> dict[str, torch.Tensor]:
    return {"k": torch.arange(n, dtype=torch.float32)}


def test_a_routed_end_sends_each_request_over_its_route_and_refuses_one_without() -> None:
    namespace = f"rl{os.getpid()}"
    shm_cfg = {"namespace": namespace}
    table = RouteTable()
    config = {
        "routes": {
            "same": {"name": "SharedMemoryConnector", "config": shm_cfg},
            "cross": {"name": "ZmqConnector", "config": {}},
        }
    }
    sender = RoutedConnector(config, table=table)
    near, far = create_connector("SharedMemoryConnector", shm_cfg), create_connector("ZmqConnector", {})
    routed_receiver = RoutedConnector(config, table=RouteTable())
    try:
        table.set("near", {"1": "same"})
        table.set("far", {1: "cross"})
        k_near, k_far, k_none = (kv_key(rid, 0, 1) for rid in ("near", "far", "lost"))
        put_near = sender.put(0, 1, k_near, _kv(4))
        assert put_near.ok and put_near.metadata["route"] == "same"
        # the KV sender's one-copy path: reserve, pack, publish (tagged like a put)
        enc = encode(_kv(6))
        reserved = sender.reserve(0, 1, k_far, enc.packed_size())
        assert isinstance(reserved, Reservation)
        enc.pack_into(reserved.buffer)
        put_far = reserved.publish()
        assert put_far.ok and put_far.metadata["route"] == "cross" and "endpoint" in put_far.metadata
        # each plain receiver (a replica with peers on one side) reads its own
        assert torch.equal(near.get(0, 1, k_near, put_near.metadata, deadline=_soon())["k"], _kv(4)["k"])
        assert torch.equal(far.get(0, 1, k_far, put_far.metadata, deadline=_soon())["k"], _kv(6)["k"])
        # a routed receiver reads each key over the route its put names
        table.set("again", {"1": "same"})
        k_again = kv_key("again", 0, 1)
        meta = sender.put(0, 1, k_again, _kv(3)).metadata
        assert torch.equal(routed_receiver.get(0, 1, k_again, meta, deadline=_soon())["k"], _kv(3)["k"])
        # a withdrawal (cleanup) reaches the key over whichever route it went
        table.set("gone", {"1": "same"})
        k_gone = kv_key("gone", 0, 1)
        gone = sender.put(0, 1, k_gone, _kv(2))
        sender.cleanup(k_gone)
        assert gone.ok and near.get(0, 1, k_gone, gone.metadata) is None
        # a request the orchestrator named no route for is refused, not guessed
        refused = sender.put(0, 1, k_none, _kv(2))
        assert not refused.ok and "no route towards stage 1" in refused.error
        health = sender.health()
        assert set(health["routes"]) == {"same", "cross"} and json.dumps(health)
        assert RoutedConnector.config_for_rank(config, 1)["routes"]["same"]["config"] == shm_cfg
        assert reap_dead_leftovers([(0, 1, "RoutedConnector", config)]) == []
    finally:
        for c in (sender, near, far, routed_receiver):
            c.close()
    assert not [n for n in os.listdir("/dev/shm") if namespace in n]


def _soon() -> float:
    import time

    return time.monotonic() + 10.0
