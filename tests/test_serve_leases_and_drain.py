"""``vllm-kvbridge serve`` (AR -> DiT over shared memory): an expired lease is a counted
metric (issue 15 item 3), and a request still running after the shutdown drain is
answered 503, never left to the HTTP server's 500.

The edge has a short lease (``lease_s: 2``; ``ttl_s: 30`` covers the hand-over before the
first renewal). The diffusion module is :class:`pipeline_fixtures.GatedDiT`: held in the
forward of ``a`` while ``x`` waits in its queue, renewed every ``lease_s / 6``. Stopped
(SIGSTOP; its heartbeat timeout is long, so it is not taken for lost), the stage renews
nothing: the LLM stage's sender drops ``x``'s KV one lease later and reports it, and
``/metrics`` counts one expired lease. No sleep decides what a test sees.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_fixtures import ROOT, Server, metric, post_images, start_serve, stop, wait_for

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.server.metrics import ServerMetrics

EXPIRED = "kvbridge_leases_expired_total"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("serve-leases")
    gates = tmp / "gates"
    gates.mkdir()
    text = (ROOT / "stage_configs" / "ar_to_dit_shm.yaml").read_text()
    replacements = {
        "class_path: vllm_kvbridge.models.tiny_dit.TinyKVDiT": "class_path: pipeline_fixtures.GatedDiT",
        "    kind: diffusion\n": f"    kind: diffusion\n    env: {{KVBRIDGE_TEST_GATES: '{gates}'}}\n",
        "      recv_timeout: 30\n      prefetch: true\n": "      recv_timeout: 10\n      prefetch: false\n",
        "extra: {ttl_s: 120}": "extra: {ttl_s: 30, lease_s: 2}",
    }
    for old, new in replacements.items():
        assert old in text, old
        text = text.replace(old, new)
    config = tmp / "leases.yaml"
    config.write_text(text + "runtime: {heartbeat_timeout: 300}\n")
    srv = start_serve(config, tmp, ensure_tiny_model())
    try:
        yield srv, gates
    finally:
        stop(srv)


def _requests(srv: Server) -> dict[str, list[int]]:
    return httpx.get(srv.url + "/debug/state", timeout=30).json()["requests"]


def _stage(srv: Server, sid: int) -> dict:
    stages = httpx.get(srv.url + "/health", timeout=30).json()["stages"]
    return next(s for s in stages if s["stage_id"] == sid)


@pytest.mark.engine
@pytest.mark.long(300, "the module's server (vLLM engine + DiT) starts in its first engine test")
@pytest.mark.slow
def test_a_kv_nobody_renews_expires_and_is_counted(served) -> None:  # type: ignore[no-untyped-def]
    srv, gates = served
    (gates / "hold").touch()
    first, answers = post_images(srv, 1, "a")
    assert wait_for(lambda: (gates / "forwarding").exists(), 120)  # a's KV was read
    second, more = post_images(srv, 1, "x")
    assert wait_for(lambda: list(_requests(srv).values()) == [[1], [1]], 120), _requests(srv)
    assert metric(srv, EXPIRED, stage="0") == 0.0

    dit = _stage(srv, 1)["pid"]
    os.killpg(dit, signal.SIGSTOP)
    try:
        assert wait_for(lambda: metric(srv, EXPIRED, stage="0") >= 1, 60)
    finally:
        os.killpg(dit, signal.SIGCONT)
    assert metric(srv, EXPIRED, stage="0", kind="llm_ar") == 1.0  # x's only: a's was read
    assert _stage(srv, 0)["counters"]["leases_expired"] == 1.0

    (gates / "hold").unlink()
    for t in first + second:
        t.join(120)
    assert answers[0].status_code == 200, answers[0].text
    x = more[0]
    assert x.status_code == 500 and "did not arrive within 10" in x.json()["error"]["message"], x.text
    assert _stage(srv, 1)["pid"] == dit, "the stopped stage was not taken for lost"
    assert metric(srv, EXPIRED, stage="0") == 1.0  # a later scrape adds nothing


@pytest.mark.engine
@pytest.mark.long(300, "the module's server (vLLM engine + DiT) starts in its first engine test")
@pytest.mark.slow
def test_a_request_still_running_after_the_drain_is_answered_503(served) -> None:  # type: ignore[no-untyped-def]
    """The last test of the module: SIGTERM with a request held in the DiT. The server's
    drain (``--drain-timeout 5``) ends before the request does: it is aborted and answered
    503 (uvicorn's own cancellation, later, would have been a 500), and the server exits 0."""
    srv, gates = served
    (gates / "forwarding").unlink(missing_ok=True)
    (gates / "hold").touch()
    threads, answers = post_images(srv, 1, "held")
    assert wait_for(lambda: (gates / "forwarding").exists(), 120)
    os.kill(srv.proc.pid, signal.SIGTERM)
    threads[0].join(60)
    assert [a.status_code for a in answers] == [503], [a.text for a in answers]
    assert "shutting down" in answers[0].json()["error"]["message"]
    assert stop(srv, signal.SIGTERM, timeout_s=60) == 0, srv.log()


def test_the_metric_follows_a_restarted_process_from_zero() -> None:
    """A restarted stage process counts from 0 again: the series keeps growing."""
    health = [{"stage_id": 0, "kind": "llm_ar", "status": "ready", "restarts": 0, "pid": 10}]
    metrics = ServerMetrics(lambda: 0.0, lambda: health)
    series = f'{EXPIRED}{{kind="llm_ar",replica="0",stage="0"}}'  # no replicas: replica "0"
    for pid, value, total in ((10, 2.0, 2.0), (10, 5.0, 5.0), (11, 1.0, 6.0), (11, 1.0, 6.0)):
        health[0].update(pid=pid, counters={"leases_expired": value, "puts_full": 0.0})
        assert f"{series} {total}" in metrics.render().decode()


def test_each_replica_has_its_own_series_and_follows_its_own_restarts() -> None:
    """A stage with replicas (issue 41): one series per replica, from its own entry under
    ``replicas``; a replica restarted counts from 0 again without touching the other's."""
    reps = [
        {"replica": k, "status": "ready", "restarts": 0, "pid": 20 + k, "counters": {"leases_expired": 1.0}}
        for k in range(2)
    ]
    health = [{"stage_id": 1, "kind": "diffusion", "status": "ready", "restarts": 0, "replicas": reps}]
    metrics = ServerMetrics(lambda: 0.0, lambda: health)
    metrics.render()
    reps[1].update(pid=30, restarts=1, status="recovering", counters={"leases_expired": 2.0})
    text = metrics.render().decode()
    assert f'{EXPIRED}{{kind="diffusion",replica="0",stage="1"}} 1.0' in text
    assert f'{EXPIRED}{{kind="diffusion",replica="1",stage="1"}} 3.0' in text
    assert 'kvbridge_stage_restarts_total{kind="diffusion",replica="1",stage="1"} 1.0' in text
    assert 'kvbridge_stage_recovering{kind="diffusion",replica="1",stage="1"} 1.0' in text
    assert 'kvbridge_stage_up{kind="diffusion",replica="0",stage="1"} 1.0' in text
    assert 'kvbridge_stage_up{kind="diffusion",replica="1",stage="1"} 0.0' in text
