"""A Mooncake master that dies under a running server (issue 36, item 6): ``/health`` said
``ok`` while every request over the store failed with ``registration ... failed``. A real
server on ``stage_configs/ar_to_dit_mooncake.yaml`` and a real ``mooncake_master``: once the
master is killed, ``/health`` answers 200 ``degraded`` naming the stages cut off (and
``kvbridge_edge_unreachable`` says how many connectors), and once a master is back on the
same address it is ``ok`` again and requests succeed.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from mooncake_fixtures import mooncake_master  # noqa: F401 - the fixture
from serve_fixtures import ROOT, metric, start_serve, stop, wait_for

from vllm_kvbridge.connectors.mooncake_master import MooncakeMaster
from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(
        300, "a server (vLLM engine + DiT) over a Mooncake store whose master is killed and started again"
    ),
]
IMAGES = "/v1/images/generations"


def test_a_dead_master_makes_the_server_degraded_until_it_is_back(
    mooncake_master: MooncakeMaster,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in mooncake_master.env("KVB_MOONCAKE").items():
        monkeypatch.setenv(name, value)  # what the shipped config reads
    srv = start_serve(ROOT / "stage_configs/ar_to_dit_mooncake.yaml", tmp_path, ensure_tiny_model())
    try:
        assert httpx.post(srv.url + IMAGES, json={"prompt": "a cat"}, timeout=120).status_code == 200
        mooncake_master.kill()

        def degraded() -> dict | None:
            r = httpx.get(srv.url + "/health", timeout=10)
            return r.json() if r.json()["status"] == "degraded" else None

        h = wait_for(degraded, 30)
        assert h, httpx.get(srv.url + "/health").json()
        assert httpx.get(srv.url + "/health").status_code == 200  # a restart would not help
        assert all(s["status"] == "ready" for s in h["stages"]), h  # up, but cut off
        assert any("cannot reach their edge's service" in d for d in h["down"]), h
        assert metric(srv, "kvbridge_edge_unreachable", stage="0", kind="llm_ar") >= 1.0

        mooncake_master.start()  # same ports: the connectors reconnect by themselves
        ok = wait_for(lambda: httpx.get(srv.url + "/health", timeout=10).json()["status"] == "ok", 60)
        assert ok, httpx.get(srv.url + "/health").json()
        assert metric(srv, "kvbridge_edge_unreachable", stage="0", kind="llm_ar") == 0.0
        r = None
        for _ in range(20):  # segments are re-mounted shortly after reconnecting
            r = httpx.post(srv.url + IMAGES, json={"prompt": "a cat again"}, timeout=120)
            if r.status_code == 200:
                break
        assert r is not None and r.status_code == 200, r.text
    finally:
        stop(srv)
