"""Stage replicas under ``vllm-kvbridge serve`` (issue 41): one real server, AR -> DiT over
shared memory with ``replicas: 2`` on the DiT, in file order.

What an operator sees (``/health`` lists each replica with its state and node, Prometheus
series carry a ``replica`` label, ``/debug/state`` says where each request went), then a
replica SIGKILLed under load: only the requests it held fail (502 naming the stage and the
replica), the server never answers 503 meanwhile, the replica comes back and serves again,
and nothing of the run is left in /dev/shm.

The DiT module is :class:`pipeline_fixtures.GatedDiT`: while the ``hold`` gate exists no
request leaves a replica, so requests split between the replicas as least-outstanding
routing sends them (nothing finishes meanwhile: ties go to replica 0, the next to the other),
and a restarted replica is not built until ``open`` exists (it stays ``recovering`` while
the test looks). No sleep decides what a test sees.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Any

import httpx
import pytest
import yaml
from serve_fixtures import ROOT, Gates, Server, metric, post_images, shm_names, start_serve, stop, wait_for

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "a server with two DiT replicas, one SIGKILLed and restarted"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("serve-replicas")
    gates = Gates(tmp / "gates")
    gates.path.mkdir()
    gates.set("open", True)  # both replicas build their module at the start
    config = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text())
    dit = config["stages"][1]
    dit.update(replicas=2, env={"KVBRIDGE_TEST_GATES": str(gates.path)})
    dit["diffusion"]["class_path"] = "pipeline_fixtures.GatedDiT"
    config["runtime"] = {"max_restarts": 2, "restart_backoff": 0.2}
    path = tmp / "ar_to_dit_replicas.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = start_serve(path, tmp, ensure_tiny_model())
    try:
        yield srv, gates
    finally:
        stop(srv)


def _health(srv: Server) -> dict[str, Any]:
    return httpx.get(srv.url + "/health", timeout=30).json()


def _dit(srv: Server) -> dict[str, Any]:
    return next(s for s in _health(srv)["stages"] if s["stage_id"] == 1)


def _state(srv: Server) -> dict[str, Any]:
    return httpx.get(srv.url + "/debug/state", timeout=30).json()


def _served_one_on_each(srv: Server, gates: Gates, prompt: str) -> None:
    """Two requests held in the DiT at once go one to each replica, and both are served."""
    gates.set("hold", True)
    try:
        threads, answers = post_images(srv, 2, prompt=prompt)
        assert wait_for(lambda: _routed(srv, 2) == [0, 1], 120), _state(srv)
    finally:
        gates.set("hold", False)
    for t in threads:
        t.join(120)
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]


def _routed(srv: Server, n: int) -> list[int] | None:
    """The DiT replica of each of the ``n`` requests in flight once all ``n`` are in the DiT
    (sorted), else None."""
    state = _state(srv)
    reqs, routed = state["requests"], state["replicas"]
    if len(reqs) != n or any(stages != [1] for stages in reqs.values()):
        return None
    return sorted(routed[rid]["1"] for rid in reqs)


def test_health_lists_each_replica_with_its_state_and_node_and_metrics_carry_the_replica(served) -> None:  # type: ignore[no-untyped-def]
    srv, gates = served
    h = httpx.get(srv.url + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok", h.text
    llm, dit = h.json()["stages"]
    here = {"id": "local", "ip": "127.0.0.1", "host": socket.gethostname()}
    assert llm["node"] == here and "replicas" not in llm  # one process: as before, and where
    assert dit["status"] == "ready" and [r["replica"] for r in dit["replicas"]] == [0, 1]
    for r in dit["replicas"]:
        assert r["status"] == "ready" and r["node"] == here and r["restarts"] == 0, r
    assert dit["replicas"][0]["pid"] != dit["replicas"][1]["pid"]  # two processes
    # every stage process has its series, a stage without replicas as replica "0"
    assert metric(srv, "kvbridge_stage_up", stage="0", kind="llm_ar", replica="0") == 1.0
    for k in ("0", "1"):
        assert metric(srv, "kvbridge_stage_up", stage="1", kind="diffusion", replica=k) == 1.0
        assert metric(srv, "kvbridge_stage_recovering", stage="1", replica=k) == 0.0
    assert metric(srv, "kvbridge_stage_up", stage="1") == 2.0  # by stage alone: summed over both

    # two requests held in the DiT go one to each replica; each one's latency counts for its own
    _served_one_on_each(srv, gates, "a red fox")
    for k in ("0", "1"):
        assert metric(srv, "kvbridge_stage_latency_seconds_count", stage="1", replica=k) == 1.0
    assert metric(srv, "kvbridge_stage_latency_seconds_count", stage="0", replica="0") == 2.0


def test_a_killed_replica_fails_only_its_requests_and_the_server_never_answers_503(served) -> None:  # type: ignore[no-untyped-def]
    srv, gates = served
    run_id = _state(srv)["run_id"]
    survivor, victim = (r["pid"] for r in _dit(srv)["replicas"])
    served_before = metric(srv, "kvbridge_stage_latency_seconds_count", stage="1", replica="1")
    gates.set("open", False)  # from now on a restarted replica waits at its gate
    gates.set("hold", True)
    threads, answers = post_images(srv, 4)
    assert wait_for(lambda: _routed(srv, 4) == [0, 0, 1, 1], 120), _state(srv)
    routed = _state(srv)["replicas"]
    lost = {rid for rid, stages in routed.items() if stages["1"] == 1}

    # /health all along the loss and the recovery: never 503, the stage never recovering
    seen: list[tuple[int, str, str]] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            try:
                r = httpx.get(srv.url + "/health", timeout=30)
                dit = next(s for s in r.json()["stages"] if s["stage_id"] == 1)
                seen.append((r.status_code, r.json()["status"], dit["status"]))
            except Exception as exc:  # recorded: the assertion below shows it
                seen.append((0, repr(exc), ""))
            watching.wait(0.05)

    watcher = threading.Thread(target=watch, name="health-watch")
    watcher.start()
    try:
        os.killpg(victim, signal.SIGKILL)
        # exactly the killed replica's two requests come back, 502 naming the stage and replica
        assert wait_for(lambda: len(answers) == 2, 60), [a.text for a in answers]
        for a in answers[:2]:
            assert a.status_code == 502, a.text
            err = a.json()["error"]
            assert err["type"] == "bad_gateway", err
            assert "stage 1 (diffusion) replica 1 failed: process exited" in err["message"], err
            assert any(f"request {rid} failed" in err["message"] for rid in lost), (err, lost)

        # replica 1 recovers (held at its gate); the stage serves on replica 0
        def recovering() -> dict[str, Any] | None:
            h = _health(srv)
            return h if h["stages"][1]["replicas"][1]["status"] == "recovering" else None

        h = wait_for(recovering, 30)
        assert h, _health(srv)
        assert h["status"] == "degraded" and h["stages"][1]["status"] == "ready", h
        assert h["stages"][1]["replicas"][0]["pid"] == survivor
        assert "process exited" in h["stages"][1]["replicas"][1]["error"]
        assert any("stage 1 (diffusion) replica 1: " in line for line in h["down"]), h["down"]
        assert sorted(_state(srv)["requests"]) == sorted(set(routed) - lost)  # the others go on
        assert metric(srv, "kvbridge_stage_recovering", stage="1", replica="1") == 1.0
        assert metric(srv, "kvbridge_stage_up", stage="1", replica="0") == 1.0
        # a new request is admitted (not 503) and avoids the recovering replica
        late_threads, late = post_images(srv, 1, prompt="a late dog")
        assert wait_for(lambda: _routed(srv, 3) == [0, 0, 0], 120), _state(srv)
        gates.set("hold", False)
        for t in threads + late_threads:
            t.join(120)
        assert [a.status_code for a in answers[2:] + late] == [200] * 3, [a.text for a in answers[2:] + late]
        # replica 1 comes back as a new process
        gates.set("open", True)

        def back() -> dict[str, Any] | None:
            h = _health(srv)
            reps = h["stages"][1]["replicas"]
            return h if h["status"] == "ok" and [r["status"] for r in reps] == ["ready", "ready"] else None

        h = wait_for(back, 120)
        assert h, _health(srv)
    finally:
        gates.set("hold", False)
        gates.set("open", True)
        watching.set()
        watcher.join(60)
    assert seen and all(code == 200 for code, _, _ in seen), seen
    assert {status for _, status, _ in seen} <= {"ok", "degraded"}, seen
    assert {dit for _, _, dit in seen} == {"ready"}, seen
    reps = h["stages"][1]["replicas"]
    assert reps[0]["pid"] == survivor and reps[1]["pid"] != victim and reps[1]["restarts"] == 1
    assert metric(srv, "kvbridge_stage_restarts_total", stage="1", replica="1") == 1.0
    assert metric(srv, "kvbridge_stage_restarts_total", stage="1", replica="0") == 0.0
    assert metric(srv, "kvbridge_request_failures_total", reason="stage_lost") == 2.0
    assert metric(srv, "kvbridge_request_failures_total", reason="stage_recovering") == 0.0

    # and it serves again: of two requests held at once, one goes to it
    _served_one_on_each(srv, gates, "a bird")
    assert metric(srv, "kvbridge_stage_latency_seconds_count", stage="1", replica="1") == served_before + 1
    # nothing published is left unread, and nothing of the run once the server stopped
    assert wait_for(lambda: not _state(srv)["shm_published"], 10), _state(srv)
    assert stop(srv) == 0, srv.log()
    assert shm_names(run_id) == []
