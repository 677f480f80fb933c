"""Stages placed across nodes through Ray (issue 17), on a real Ray cluster of this machine.

One cluster per module: a head and two simulated nodes (``ray.cluster_utils.Cluster``),
told apart by custom resources ``node_a`` / ``node_b``; their node ids differ, so for the
locality rule they are two nodes even though they share this machine's /dev/shm. The AR
-> DiT pipeline of ``stage_configs/ar_to_dit_ray.yaml`` runs with real engines:

* ``vllm-kvbridge serve --ray-address`` with stage 0 pinned to node A and stage 1 to node
  B: the ``auto`` edge becomes ZMQ over TCP on the node's address, the DiT's KV is
  transformers' KV of the request, and killing stage 1's actor fails the request in it,
  naming the stage, without a hang (one server for both: each pipeline start costs two
  engine starts);
* both stages on node A (``Pipeline``): the same edge becomes shared memory;
* a stage no node can take fails the start, naming it.

Only the cluster this module started is stopped (never ``ray stop``).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml
from pipeline_fixtures import (
    AR_TO_DIT_KWARGS,
    TESTS_DIR,
    check_dumped_kv_is_transformers_kv,
    check_kv_is_greedy_transformers_kv,
    dumped_kv,
)
from serve_fixtures import ROOT, free_port, post_images, start_process, stop, wait_for

from vllm_kvbridge.cli.run import write_outputs
from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline, StageError

ray = pytest.importorskip("ray")  # an extra ([ray]); make setup installs it
pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "pipelines on a simulated Ray cluster: actors start vLLM engines"),
]
CONFIG = ROOT / "stage_configs/ar_to_dit_ray.yaml"


class RayNodes:
    def __init__(self, cluster, node_a, node_b) -> None:  # type: ignore[no-untyped-def]
        self.cluster, self.address = cluster, cluster.address
        self.node_a, self.node_b = node_a.node_id, node_b.node_id

    def free(self, resource: str) -> float:
        return ray.available_resources().get(resource, 0.0)


@pytest.fixture(scope="module")
def nodes():  # type: ignore[no-untyped-def]
    from ray.cluster_utils import Cluster

    # Ray's socket paths must stay short: a directory of its own right under /tmp.
    tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        a = cluster.add_node(num_cpus=1, resources={"node_a": 1})
        b = cluster.add_node(num_cpus=1, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield RayNodes(cluster, a, b)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old
        shutil.rmtree(tmp, ignore_errors=True)


def _config(tmp: Path, placements: list[dict[str, float]], **stage1_extra) -> Path:  # type: ignore[no-untyped-def]
    """The Ray config with each stage's placement resources replaced (and stage 1's extra keys)."""
    spec = yaml.safe_load(CONFIG.read_text())
    for stage, resources in zip(spec["stages"], placements):
        stage["placement"] = {"resources": resources}
    spec["stages"][1].update(stage1_extra)
    path = tmp / "ray_edited.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _run(nodes: RayNodes, config: Path, dump: Path):  # type: ignore[no-untyped-def]
    import msgspec

    model = ensure_tiny_model()
    logs = dump / "logs"
    pipe = Pipeline.from_config(config, model=str(model), ray_address=nodes.address, log_dir=logs)
    pipe.plan = msgspec.structs.replace(
        pipe.plan, stages=[msgspec.structs.replace(s, debug_dump_dir=str(dump)) for s in pipe.plan.stages]
    )
    with pipe:
        [result] = pipe.generate(["A cute cat"])
        held = (nodes.free("node_a"), nodes.free("node_b"))
    check_dumped_kv_is_transformers_kv(model, result, dump, {**AR_TO_DIT_KWARGS, "seed": 0})
    return result, pipe.plan, held


def _released(nodes: RayNodes) -> bool:
    """Every actor of the run is gone: the nodes' resources are free again."""
    return bool(wait_for(lambda: nodes.free("node_a") == 1 and nodes.free("node_b") == 1, 30))


def test_stages_on_one_node_pick_shared_memory(nodes: RayNodes, tmp_path: Path) -> None:
    half = {"node_a": 0.5}  # node A has one unit of node_a: room for both stages
    result, plan, held = _run(nodes, _config(tmp_path, [half, half]), tmp_path)
    # each stage's log, written on its node, was copied into the run's log directory
    assert "vLLM" in (tmp_path / "logs/stage_0.log").read_text(errors="replace")
    assert [s.node_id for s in result.stages] == [nodes.node_a, nodes.node_a]
    assert held == (0, 1)
    edge = plan.stage(0).outputs[0].connector
    assert edge.name == "SharedMemoryConnector" and "on one node" in edge.reason, edge
    assert _released(nodes), ray.available_resources()
    # nothing of the run's edge is left in /dev/shm (its segments live in the run's namespace)
    namespace = edge.config["namespace"]
    assert namespace.endswith("-0-1") and not [n for n in os.listdir("/dev/shm") if namespace in n]
    # what `vllm-kvbridge run` writes: the edge's connector and each stage's node
    record = write_outputs([result], plan, tmp_path / "out", time.time())["requests"][0]
    assert [t["connector"] for t in record["transfers"]] == ["SharedMemoryConnector"]
    assert [s["node_id"] for s in record["stages"]] == [nodes.node_a, nodes.node_a]


def _stage_actor(stage_id: int):  # type: ignore[no-untyped-def]
    """The live actor of ``stage_id`` of the one pipeline running on the cluster."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("kvbridge-")]
    [mine] = [a for a in names if f"-stage-{stage_id}-" in a["name"]]
    return ray.get_actor(mine["name"], namespace=mine["namespace"])


def test_serve_on_two_nodes_moves_kv_over_tcp_and_fails_the_request_of_a_killed_stage_actor(
    nodes: RayNodes, tmp_path: Path
) -> None:
    gates, dump = tmp_path / "gates", tmp_path / "dump"
    gates.mkdir()
    env = {"PYTHONPATH": str(TESTS_DIR), "KVBRIDGE_TEST_GATES": str(gates)}
    config = _config(tmp_path, [{"node_a": 1}, {"node_b": 1}], env=env)
    spec = yaml.safe_load(config.read_text())
    spec["stages"][1]["diffusion"]["class_path"] = "pipeline_fixtures.GatedDiT"
    spec["runtime"]["debug_dump_dir"] = str(dump)
    config.write_text(yaml.safe_dump(spec))
    model, port = ensure_tiny_model(), free_port()
    argv = [
        sys.executable, "-m", "vllm_kvbridge.cli.main", "serve", "--stage-config", str(config),
        "--port", str(port), "--model", str(model), "--ray-address", nodes.address,
        "--log-dir", str(tmp_path / "logs"),  # kept (a stage is killed): not in the temp dir
    ]  # fmt: skip
    srv = start_process(argv, tmp_path / "serve.log", f"http://127.0.0.1:{port}", "/health", 300)
    try:
        r = httpx.post(srv.url + "/v1/images/generations", json={"prompt": "a cat"}, timeout=120)
        assert r.status_code == 200 and r.json()["data"], r.text
        stages = httpx.get(srv.url + "/health", timeout=30).json()["stages"]
        assert [s["status"] for s in stages] == ["ready", "ready"], stages
        assert [s["node_id"] for s in stages] == [nodes.node_a, nodes.node_b]
        assert (nodes.free("node_a"), nodes.free("node_b")) == (0, 0)  # each actor holds its node's
        # the auto edge became ZMQ served on node A's address, not loopback (its CURVE keys:
        # test_locality.py); the DiT on node B consumed transformers' KV of the request
        ip = ray.util.get_node_ip_address()
        assert not ip.startswith("127.")
        assert f"[edge 0->1] ZmqConnector (auto: stage 0 on node {nodes.node_a[:12]} ({ip})" in srv.log()
        [kv_file] = dump.glob("stage1_*_kv.safetensors")
        max_tokens = yaml.safe_load(CONFIG.read_text())["stages"][0]["default_sampling_params"]["max_tokens"]
        check_kv_is_greedy_transformers_kv(model, "a cat", dumped_kv(kv_file), max_tokens)

        (gates / "forwarding").unlink()  # the first request's forward touched it
        (gates / "hold").touch()  # the next request stays in the DiT's forward
        threads, answers = post_images(srv, 1)
        assert wait_for(lambda: (gates / "forwarding").exists(), 120), srv.log()
        t0 = time.monotonic()
        ray.kill(_stage_actor(1))
        threads[0].join(120)
        assert answers and answers[0].status_code == 502, [a.text for a in answers]
        message = answers[0].json()["error"]["message"]
        assert "stage 1 (diffusion)" in message and "Ray actor" in message, message
        print(f"\nrequest failed {time.monotonic() - t0:.1f} s after its stage's actor was killed")
    finally:
        stop(srv)
    assert _released(nodes), ray.available_resources()


def test_a_stage_no_node_can_take_fails_the_start_naming_it(nodes: RayNodes, tmp_path: Path) -> None:
    config = _config(tmp_path, [{"node_a": 1}, {"node_z": 1}], start_timeout=3)
    model = str(ensure_tiny_model())
    pipe = Pipeline.from_config(config, model=model, ray_address=nodes.address, log_dir=tmp_path / "logs")
    with pytest.raises(StageError) as info:
        pipe.start()
    assert info.value.stage_id == 1
    assert "not placed after 3 s (start_timeout): no Ray node has" in str(info.value)
    assert "node_z" in str(info.value)
    assert _released(nodes), ray.available_resources()  # stage 0's actor, placed, was killed
    # a replica no node can take: the error names it (its sibling, placed, is released too)
    replicas = [{"resources": {"node_b": 1}}, {"resources": {"node_z": 1}}]
    config = _config(tmp_path, [{"node_a": 1}, {}], start_timeout=3, replicas=2, placement=replicas)
    pipe = Pipeline.from_config(config, model=model, ray_address=nodes.address, log_dir=tmp_path / "logs")
    with pytest.raises(StageError) as info:
        pipe.start()
    assert (info.value.stage_id, info.value.replica) == (1, 1)
    assert str(info.value).startswith("stage 1 (diffusion) replica 1 failed: not placed after 3 s")
    assert _released(nodes), ray.available_resources()


def test_dit_replicas_on_two_nodes_get_shared_memory_and_tcp_each_from_the_llm_stage(
    nodes: RayNodes, tmp_path: Path
) -> None:
    """Issue 41 through Ray: the LLM stage and DiT replica 0 on node A, replica 1 on node B
    (a placement per replica). The auto edge is picked per pair: shared memory to replica 0,
    ZMQ over TCP to replica 1, so the LLM stage's end is routed and each request's KV goes
    over its pair's. 4 requests at once: the DiT replica of each is picked when it enters
    the LLM stage (least outstanding: 0, 1, 0, 1, whatever the timing), and every image is
    what the single-replica DiT paints from transformers' KV of the request."""
    from vllm_kvbridge.cli.check_config import format_plan
    from vllm_kvbridge.config import resolve

    spec = yaml.safe_load(CONFIG.read_text())
    spec["stages"][0]["placement"] = {"resources": {"node_a": 0.5}}
    dit = spec["stages"][1]
    dit.update(replicas=2, placement=[{"resources": {"node_a": 0.5}}, {"resources": {"node_b": 1}}])
    dit["diffusion"]["max_batch_size"] = 1  # each image exactly the unbatched one
    config = tmp_path / "ray_replicas.yaml"
    config.write_text(yaml.safe_dump(spec))
    text = format_plan(resolve(config))  # what check-config prints: each replica and where it goes
    assert "    replica 0: a Ray actor holding node_a: 0.5" in text
    assert "    replica 1: a Ray actor holding node_b: 1" in text
    assert "auto edges: picked per pair of replicas" in text

    import msgspec

    model, lines = ensure_tiny_model(), []
    pipe = Pipeline.from_config(
        config, model=str(model), ray_address=nodes.address, log_dir=tmp_path / "logs", progress=lines.append
    )
    pipe.plan = msgspec.structs.replace(
        pipe.plan, stages=[msgspec.structs.replace(s, debug_dump_dir=str(tmp_path)) for s in pipe.plan.stages]
    )
    prompts = [f"A cute cat number {i}" for i in range(4)]
    with pipe:
        results = pipe.generate(prompts)
        plan = pipe.plan
    log = "\n".join(lines)
    same = "auto: stage 0 and stage 1 replica 0 on one node"
    assert f"[edge 0->1 replica 0->0] SharedMemoryConnector ({same} ({nodes.node_a[:12]}" in log
    assert f"[edge 0->1 replica 0->1] ZmqConnector (auto: stage 0 on node {nodes.node_a[:12]}" in log
    assert plan.copies(0)[0].outputs[0].connector.name == "RoutedConnector"
    record = write_outputs(results, plan, tmp_path / "out", time.time())["requests"]
    served = [next(s for s in r["stages"] if s["stage_id"] == 1) for r in record]
    print(f"\nDiT replica per request: {[s['replica'] for s in served]}")
    assert [s["replica"] for s in served] == [0, 1, 0, 1]
    assert [s["node_id"] for s in served] == [nodes.node_a, nodes.node_b] * 2
    used = [[t["connector"] for t in r["transfers"]] for r in record]
    assert used == [["SharedMemoryConnector"], ["ZmqConnector"]] * 2, used
    for result in results:
        check_dumped_kv_is_transformers_kv(model, result, tmp_path, {**AR_TO_DIT_KWARGS, "seed": 0})
    for k in (0, 1):  # each replica's log, written on its node, copied into the run's
        assert "stage 1 rank 0 shut down" in (tmp_path / f"logs/stage_1.replica{k}.log").read_text(
            errors="replace"
        )
    assert _released(nodes), ray.available_resources()
    namespace = plan.copies(1)[0].inputs[0].connector.config["namespace"]
    assert not [n for n in os.listdir("/dev/shm") if namespace in n]
