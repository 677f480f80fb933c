"""``connector: auto`` and the placement settings (issue 17, item 2), without a cluster:
what an edge becomes for where its stages run, the config errors, check-config's lines,
the control socket's CURVE beyond loopback, and the Ray backend's error without Ray."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import msgspec
import pytest

from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.config.locality import NodeInfo, bind_auto_edges, local_node
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.pipeline.placement import LocalBackend, make_backend, place_stages
from vllm_kvbridge.pipeline.results import PipelineError

ROOT = Path(__file__).resolve().parents[1]
BASE = {
    "stages": [
        {"stage_id": 0, "kind": "llm_ar", "kv_transfer": {"need_send_cache": True}},
        {"stage_id": 1, "kind": "diffusion", "kv_transfer": {"need_recv_cache": True}},
    ],
}
A = NodeInfo("node-a", "10.0.0.2", "boot1:1:1")
B = NodeInfo("node-b", "10.0.0.3", "boot2:1:1")


def _plan(**changes):  # type: ignore[no-untyped-def]
    data = copy.deepcopy(BASE)
    for key, value in changes.items():
        data[key] = value
    return resolve_spec(spec_from_dict(data, env={}))


def _ends(plan) -> list:  # type: ignore[no-untyped-def]
    return [plan.stage(0).outputs[0].connector, plan.stage(1).inputs[0].connector]


def test_an_edge_naming_no_connector_is_picked_by_locality() -> None:
    plan = _plan()
    assert [c.name for c in _ends(plan)] == ["auto", "auto"]
    same = bind_auto_edges(plan, {0: A, 1: A})
    assert [c.name for c in _ends(same)] == ["SharedMemoryConnector"] * 2
    assert "on one node" in _ends(same)[0].reason
    cross = bind_auto_edges(plan, {0: A, 1: B})
    send, recv = _ends(cross)
    assert send.name == recv.name == "ZmqConnector"
    assert send.config["host"] == "10.0.0.2"  # the sender serves on its node's address
    assert "stage 0 on node node-a (10.0.0.2), stage 1 on node node-b (10.0.0.3)" in send.reason
    # one Ray node id but another /dev/shm (a container of its own) is not one node
    other_shm = NodeInfo("node-a", "10.0.0.2", "boot1:9:9")
    assert _ends(bind_auto_edges(plan, {0: A, 1: other_shm}))[0].name == "ZmqConnector"


def test_auto_uses_the_runtime_connectors_and_one_named_end_wins() -> None:
    plan = _plan(
        connectors={"big": {"name": "zmq", "extra": {"max_inflight_bytes": 1024, "host": "0.0.0.0"}}},
        runtime={"cross_node_connector": "big", "same_node_connector": "zmq"},
    )
    assert _ends(bind_auto_edges(plan, {0: A, 1: A}))[0].name == "ZmqConnector"
    send = _ends(bind_auto_edges(plan, {0: A, 1: B}))[0]
    assert send.ref == "big" and send.config == {"max_inflight_bytes": 1024, "host": "0.0.0.0"}
    # `connector: auto` on the edge, one end naming its own: both ends use that one
    named = copy.deepcopy(BASE)
    named["edges"] = [{"from_stage": 0, "to_stage": 1, "connector": "auto"}]
    named["stages"][1]["input_connectors"] = {"from_stage_0": "zmq"}
    plan = resolve_spec(spec_from_dict(named, env={}))
    assert [c.name for c in _ends(plan)] == ["ZmqConnector"] * 2


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"runtime": {"same_node_connector": "auto"}}, "runtime.same_node_connector: must name a connector"),
        ({"runtime": {"cross_node_connector": "pigeon"}}, "runtime.cross_node_connector: unknown connector"),
        (
            {"runtime": {"backend": "local", "ray_address": "auto"}},
            "runtime.ray_address: only with backend 'ray'",
        ),
    ],
)
def test_bad_runtime_placement_settings_name_the_key(changes, expected: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=f"^{expected}"):
        _plan(**changes)


def test_bad_placement_resources_name_the_key() -> None:
    data = copy.deepcopy(BASE)
    data["stages"][1]["placement"] = {"resources": {"GPU": -1}}
    with pytest.raises(ConfigError, match=r"^stages\[1\]\.placement\.resources\.GPU: must be >= 0"):
        resolve_spec(spec_from_dict(data, env={}))
    data["stages"][1]["placement"] = {"resources": {"GPU": 1}, "node": "x"}
    with pytest.raises(ConfigError, match=r"stages\[1\]\.placement\.node"):
        resolve_spec(spec_from_dict(data, env={}))


def test_a_ray_address_selects_the_ray_backend() -> None:
    assert _plan().backend == "local"
    plan = _plan(runtime={"ray_address": "10.0.0.1:6379"})
    assert (plan.backend, plan.ray_address) == ("ray", "10.0.0.1:6379")


def test_the_local_backend_binds_auto_edges_to_shared_memory_in_the_run_namespace() -> None:
    lines: list[str] = []
    plan = place_stages(_plan(), LocalBackend(), "rtest", lines.append)
    send, recv = _ends(plan)
    assert send.name == recv.name == "SharedMemoryConnector"
    assert send.config["namespace"] == recv.config["namespace"] == "rtest-0-1"
    assert lines == [f"[edge 0->1] SharedMemoryConnector ({send.reason})"]
    assert local_node().shares_memory_with(local_node())


class TwoNodes(LocalBackend):
    """Stage 0 on node A, stage 1 on node B: what Ray's placement reports for the AR -> DiT
    pipeline of tests/test_ray_pipeline.py (which runs it on a real cluster)."""

    def place(self, stages):  # type: ignore[no-untyped-def]
        return {s.stage_id: (A, B)[s.stage_id] for s in stages}


def test_an_edge_across_nodes_binds_the_senders_node_address_with_curve_keys_for_the_run() -> None:
    lines: list[str] = []
    plan = place_stages(_plan(), TwoNodes(), "rtest", lines.append)
    send, recv = _ends(plan)
    assert send.name == recv.name == "ZmqConnector"
    assert send.config["host"] == "10.0.0.2"  # node A's address, not loopback
    # beyond loopback the edge gets a keypair made for this run, in both stages' environment
    var = send.config["curve_keys_env"]
    assert var == recv.config["curve_keys_env"] and var.startswith("KVBRIDGE_CURVE_")
    keys = json.loads(plan.stage(0).env[var])
    assert keys == json.loads(plan.stage(1).env[var]) and len(keys["public"]) == len(keys["secret"]) == 40
    assert lines == [f"[edge 0->1] ZmqConnector ({send.reason})"]
    assert "stage 0 on node node-a (10.0.0.2)" in lines[0]


def test_check_config_says_what_auto_becomes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from vllm_kvbridge.cli.main import main

    assert main(["check-config", str(ROOT / "stage_configs/ar_to_dit_ray.yaml")]) == 0
    out = capsys.readouterr().out
    assert "backend: ray (--ray-address)" in out
    assert "placement: a Ray actor holding node_a: 1\n" in out
    assert (
        "-> stage 1: auto: SharedMemoryConnector ('shm') when both ends share a node, ZmqConnector ('zmq')"
        " across nodes (backend ray: decided at placement by Ray) sends kv" in out
    )
    local = tmp_path / "local.yaml"
    local.write_text(json.dumps({**BASE, "name": "local"}))
    assert main(["check-config", str(local)]) == 0
    out = capsys.readouterr().out
    assert "-> stage 1: SharedMemoryConnector ('shm', auto: local backend, one host) sends kv" in out
    assert "backend: local (this host)" in out


def test_the_ray_backend_without_ray_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    plan = msgspec.structs.replace(_plan(), backend="ray")
    with pytest.raises(PipelineError, match=r"the Ray backend needs Ray: pip install 'vllm-kvbridge\[ray\]'"):
        make_backend(plan, "rtest")
    assert isinstance(make_backend(_plan(), "rtest"), LocalBackend)


def test_run_on_ray_without_a_cluster_fails_clearly(tmp_path: Path) -> None:
    import os
    import subprocess

    from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

    # an empty Ray temp dir and no RAY_ADDRESS: `auto` finds no cluster to join
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "run", "--ray-address", "auto"]
    argv += ["--stage-config", str(ROOT / "stage_configs/ar_to_dit_ray.yaml"), "--prompt", "a cat"]
    argv += ["--model", str(ensure_tiny_model()), "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "error: cannot join the Ray cluster at 'auto'" in proc.stderr, proc.stderr
