"""Supervised stages under ``vllm-kvbridge serve`` (issue 15, item 1): one real server (AR ->
DiT over shared memory) whose stages are killed, stalled and restarted, in file order.

The diffusion module is :class:`pipeline_fixtures.GatedDiT`: files in a gate directory
hold its forward (requests stay in the stage, which keeps beating) and hold a restart before
it is ready (the stage stays ``recovering``), so each state a test looks at lasts until the
test moves on; no sleep decides the outcome. The LLM stage's worker is
:class:`wedged_worker.GatedWorker`, whose steps a gate holds (a wedged worker). The config
allows 3 restarts per stage in 600 s and calls a stage stalled after 6 s without a
heartbeat or without engine progress.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from pipeline_fixtures import descendants, run_names
from serve_fixtures import ROOT, Gates, Server, metric, post_images, shm_names, start_serve, stop, wait_for

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline.stage_handles import group_alive

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(
        300, "a server whose stages are killed, stopped and wedged, each restarted (a vLLM engine start)"
    ),
]
HEARTBEAT_TIMEOUT_S = 6
IMAGES = "/v1/images/generations"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("serve-supervision")
    gates = tmp / "gates"
    gates.mkdir()
    text = (ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text()
    text = text.replace(
        "class_path: vllm_kvbridge.models.tiny_dit.TinyKVDiT", "class_path: pipeline_fixtures.GatedDiT"
    )
    text = text.replace(
        "    kind: diffusion\n", f"    kind: diffusion\n    env: {{KVBRIDGE_TEST_GATES: '{gates}'}}\n"
    )
    text = text.replace(  # a worker the tests can wedge: wedged_worker.py
        "    kind: llm_ar\n",
        "    kind: llm_ar\n    worker_cls: wedged_worker.GatedWorker\n"
        f"    env: {{KVBRIDGE_TEST_GATES: '{gates}'}}\n",
    )
    text += f"runtime: {{max_restarts: 3, restart_backoff: 0.2, heartbeat_timeout: {HEARTBEAT_TIMEOUT_S}}}\n"
    config = tmp / "supervised.yaml"
    config.write_text(text)
    srv = start_serve(config, tmp, ensure_tiny_model())
    try:
        yield srv, Gates(gates)
    finally:
        stop(srv)


def _health(srv: Server) -> dict:
    return httpx.get(srv.url + "/health", timeout=30).json()


def _stage(srv: Server, sid: int) -> dict:
    return next(s for s in _health(srv)["stages"] if s["stage_id"] == sid)


def _in_stage(srv: Server, sid: int, n: int) -> bool:
    """``n`` requests are in flight, every one of them in stage ``sid``."""
    reqs = httpx.get(srv.url + "/debug/state", timeout=30).json()["requests"]
    return len(reqs) == n and all(stages == [sid] for stages in reqs.values())


def _back(srv: Server, sid: int, old_pid: int, timeout_s: float) -> dict | None:
    def ready() -> dict | None:
        h = _health(srv)
        s = next(s for s in h["stages"] if s["stage_id"] == sid)
        return h if h["status"] == "ok" and s["pid"] != old_pid else None

    return wait_for(ready, timeout_s)


def test_killed_diffusion_stage_fails_its_requests_and_comes_back(served) -> None:  # type: ignore[no-untyped-def]
    srv, gates = served
    llm_pid, dit_pid = _stage(srv, 0)["pid"], _stage(srv, 1)["pid"]
    gates.set("hold", True)
    # One request denoising (held), the next one's KV prefetched, the third one's unread.
    threads, answers = post_images(srv, 3)
    assert wait_for(lambda: _in_stage(srv, 1, 3), 120), httpx.get(srv.url + "/debug/state").json()
    os.kill(dit_pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    # exactly the requests in the stage fail, naming it
    assert [a.status_code for a in answers] == [502] * 3, [a.text for a in answers]
    for a in answers:
        err = a.json()["error"]
        assert err["type"] == "bad_gateway" and "stage 1 (diffusion) failed: process exited" in err["message"]
    # the LLM stage withdrew the KV nobody will read (not left to its lease or TTL)
    state = lambda: httpx.get(srv.url + "/debug/state").json()  # noqa: E731
    assert wait_for(lambda: not state()["shm_published"], 10), state()

    # the restart waits at its gate: the stage is recovering and new requests are refused
    h = wait_for(lambda: (lambda h: h if h["status"] == "degraded" else None)(_health(srv)), 30)
    assert h, _health(srv)
    dit = h["stages"][1]
    assert dit["status"] == "recovering" and dit["restarts"] == 1 and "exited" in dit["error"]
    # degraded, not down: a liveness probe must not kill a server that heals itself
    assert httpx.get(srv.url + "/health").status_code == 200
    r = httpx.post(srv.url + IMAGES, json={"prompt": "too early"}, timeout=60)
    assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
    assert "stage 1 (diffusion) is restarting" in r.json()["error"]["message"]
    assert metric(srv, "kvbridge_stage_recovering", stage="1") == 1.0
    assert h["stages"][0]["status"] == "ready" and h["stages"][0]["pid"] == llm_pid  # kept running

    gates.set("hold", False)
    gates.set("open", True)
    t0 = time.monotonic()
    assert _back(srv, 1, dit_pid, 120), _health(srv)
    print(f"\ndiffusion stage back {time.monotonic() - t0:.1f} s after its gate opened")
    r = httpx.post(srv.url + IMAGES, json={"prompt": "a cat again"}, timeout=120)
    assert r.status_code == 200, r.text
    assert _stage(srv, 0)["pid"] == llm_pid and _stage(srv, 0)["restarts"] == 0
    assert metric(srv, "kvbridge_stage_restarts_total", stage="1") == 1.0
    assert metric(srv, "kvbridge_stage_recovering", stage="1") == 0.0
    assert metric(srv, "kvbridge_request_failures_total", reason="stage_lost") == 3.0
    assert metric(srv, "kvbridge_request_failures_total", reason="stage_recovering") == 1.0


def test_stalled_stage_is_found_by_its_heartbeat_and_restarted(served) -> None:  # type: ignore[no-untyped-def]
    """A stage busy in a long step keeps beating (the held forward); one whose process is
    stopped does not, and is killed and restarted once the heartbeat timeout passed."""
    srv, gates = served
    dit_pid = _stage(srv, 1)["pid"]
    gates.set("hold", True)
    threads, answers = post_images(srv, 1)
    assert wait_for(lambda: _in_stage(srv, 1, 1), 120)
    time.sleep(HEARTBEAT_TIMEOUT_S + 1)  # held past the timeout, yet beating: not stalled
    dit = _stage(srv, 1)
    assert dit["status"] == "ready" and dit["pid"] == dit_pid, dit
    os.kill(dit_pid, signal.SIGSTOP)
    t0 = time.monotonic()
    threads[0].join(120)
    took = time.monotonic() - t0
    assert answers[0].status_code == 502, answers[0].text
    assert "stage 1 (diffusion) failed: no heartbeat for" in answers[0].json()["error"]["message"]
    assert took >= HEARTBEAT_TIMEOUT_S - 1  # its last beat was at most a beat before the stop
    assert wait_for(lambda: not group_alive(dit_pid), 30)  # the stopped process was killed
    gates.set("hold", False)
    assert _back(srv, 1, dit_pid, 120), _health(srv)
    assert httpx.post(srv.url + IMAGES, json={"prompt": "a dog"}, timeout=120).status_code == 200
    assert _stage(srv, 1)["restarts"] == 2


def test_killed_llm_stage_fails_its_request_and_is_back_within_one_engine_start(served) -> None:  # type: ignore[no-untyped-def]
    srv, _ = served
    llm_pid, dit_pid = _stage(srv, 0)["pid"], _stage(srv, 1)["pid"]
    os.killpg(llm_pid, signal.SIGSTOP)  # the stage and its engine core: the request stays in it
    threads, answers = post_images(srv, 1)
    try:
        assert wait_for(lambda: _in_stage(srv, 0, 1), 60)
    finally:
        os.killpg(llm_pid, signal.SIGKILL)
    threads[0].join(120)
    assert (
        answers[0].status_code == 502 and "stage 0 (llm_ar) failed" in answers[0].json()["error"]["message"]
    )
    t0 = time.monotonic()
    assert _back(srv, 0, llm_pid, 300), _health(srv)
    print(f"\nLLM stage back {time.monotonic() - t0:.1f} s after it was killed (one engine start)")
    r = httpx.post(srv.url + IMAGES, json={"prompt": "a bird"}, timeout=120)
    assert r.status_code == 200, r.text
    assert _stage(srv, 1)["pid"] == dit_pid  # the diffusion stage was not restarted


def _engine_pids(stage_pid: int) -> list[int]:
    return descendants(stage_pid)  # the vLLM engine core (and its worker, in one process here)


def test_stopped_engine_core_of_an_idle_stage_is_found_and_restarted(served) -> None:  # type: ignore[no-untyped-def]
    """The stage process keeps beating, its engine core is stopped (issue 36, item 2): found
    by the stopped state of its process within the heartbeat timeout, killed, restarted."""
    srv, _ = served
    llm_pid = _stage(srv, 0)["pid"]
    engine = _engine_pids(llm_pid)
    assert engine, "the LLM stage has no engine-core process"
    for pid in engine:
        os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()

    def recovering() -> dict | None:
        s = _stage(srv, 0)
        return s if s["status"] == "recovering" else None

    s = wait_for(recovering, 60)
    took = time.monotonic() - t0
    assert s, _health(srv)
    print(f"\nstopped engine core found {took:.1f} s after the stop (timeout {HEARTBEAT_TIMEOUT_S} s)")
    assert "its engine made no progress" in s["error"] and "stopped (state T)" in s["error"], s
    assert took >= HEARTBEAT_TIMEOUT_S - 1  # not before the timeout
    assert httpx.get(srv.url + "/health").status_code == 200  # degraded while it recovers
    assert all(wait_for(lambda pid=pid: not group_alive(pid), 30) for pid in [llm_pid, *engine])
    assert _back(srv, 0, llm_pid, 300), _health(srv)
    r = httpx.post(srv.url + IMAGES, json={"prompt": "a horse"}, timeout=120)
    assert r.status_code == 200, r.text


def test_wedged_llm_worker_fails_its_request_and_is_restarted(served) -> None:  # type: ignore[no-untyped-def]
    """A worker stuck in a step (not stopped: a deadlock, a hung collective) leaves the stage
    beating and its engine core waiting: the progress board shows no step, the request fails
    naming it once the heartbeat timeout passed, and the stage comes back."""
    srv, gates = served
    llm_pid = _stage(srv, 0)["pid"]
    gates.set("llm_hold", True)
    try:
        threads, answers = post_images(srv, 1)
        assert wait_for(lambda: (gates.path / "llm_wedged").exists(), 60)
        # on its way to the timeout, /health shows the stall of a stage still ready
        s = wait_for(lambda: (lambda s: s if s.get("stalled_s") else None)(_stage(srv, 0)), 30)
        assert s and s["status"] == "ready" and "made no step" in s["stall"], _stage(srv, 0)
        threads[0].join(120)
    finally:
        gates.set("llm_hold", False)
    assert answers[0].status_code == 502, answers[0].text
    message = answers[0].json()["error"]["message"]
    assert "stage 0 (llm_ar) failed: its engine made no progress" in message and "made no step" in message
    assert wait_for(lambda: not group_alive(llm_pid), 30)
    assert _back(srv, 0, llm_pid, 300), _health(srv)
    r = httpx.post(srv.url + IMAGES, json={"prompt": "a fox"}, timeout=120)
    assert r.status_code == 200, r.text
    assert _stage(srv, 0)["restarts"] == 3


def test_a_stage_out_of_restarts_takes_the_pipeline_down_and_sigterm_cleans_up(served) -> None:  # type: ignore[no-untyped-def]
    srv, _ = served
    run_id = httpx.get(srv.url + "/debug/state").json()["run_id"]
    # vLLM's message queues and semaphores of the run (what its owner files recorded)
    queues = {n for n in run_names(run_id) if n.startswith(("psm_", "sem.mp-"))}
    assert queues
    pids = [s["pid"] for s in _health(srv)["stages"]]
    os.kill(pids[0], signal.SIGKILL)  # its fourth loss in the window: no restart left

    def down() -> dict | None:
        # Until the orchestrator has noticed the exit the stage reads "stopped" (unavailable,
        # no error yet): wait for the pipeline's own verdict.
        h = _health(srv)
        return h if h["status"] == "down" and h["error"] else None

    h = wait_for(down, 30)
    assert h, _health(srv)
    assert httpx.get(srv.url + "/health").status_code == 503  # down for good
    assert "not restarted: 3 restart(s) in the last 600 s (runtime.max_restarts: 3)" in h["error"]
    r = httpx.post(srv.url + IMAGES, json={"prompt": "a cat"}, timeout=30)
    assert r.status_code == 503 and "stage 0 (llm_ar)" in r.json()["error"]["message"]
    assert stop(srv, signal.SIGTERM, timeout_s=60) == 0, srv.log()
    for pid in pids:
        assert wait_for(lambda pid=pid: not group_alive(pid), 10), group_alive(pid)
    assert shm_names(run_id) == []
    # what the killed engines could not remove (vLLM's message queues) was removed for them
    assert queues & set(os.listdir("/dev/shm")) == set()
