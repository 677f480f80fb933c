"""``vllm-kvbridge serve`` in front of AR -> DiT (shared memory): one real server for the module.

The server runs as a subprocess on loopback and is driven with real HTTP clients (the
``openai`` package and httpx). Tests run in file order on the same server; the last one
kills a stage (it is restarted) and then shuts the server down with SIGTERM.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import struct
import threading

import httpx
import openai
import pytest
from serve_fixtures import ROOT, Server, shm_names, start_serve, stop, wait_for

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline.stage_handles import group_alive

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(
        300, "the module's server (vLLM engine + DiT) starts in its first test; a stage is restarted"
    ),
]
CONFIG = ROOT / "stage_configs/ar_to_dit_shm.yaml"
MODEL_NAME = "ar_to_dit_shm"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("serve-ar-dit")
    srv = start_serve(CONFIG, tmp, ensure_tiny_model())
    try:
        yield srv
    finally:
        stop(srv)


def _client(server: Server, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()) and head.split("{")[0] == name:
            total += float(value)
    return total


def test_health_models_and_images(server: Server) -> None:
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and [s["status"] for s in h["stages"]] == ["ready", "ready"]
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]

    client = _client(server)
    res = client.images.generate(model=MODEL_NAME, prompt="A cute cat", response_format="b64_json")
    png = base64.b64decode(res.data[0].b64_json or "")
    assert _png_size(png) == (32, 32)
    # the same prompt and seed give the same image; another seed another one
    again = client.images.generate(model=MODEL_NAME, prompt="A cute cat", response_format="b64_json")
    assert base64.b64decode(again.data[0].b64_json or "") == png
    other = client.images.generate(
        model=MODEL_NAME, prompt="A cute cat", response_format="b64_json", extra_body={"seed": 7}
    )
    assert base64.b64decode(other.data[0].b64_json or "") != png

    res = client.images.generate(model=MODEL_NAME, prompt="A dog", response_format="url", n=2)
    assert len(res.data) == 2
    for d in res.data:
        got = httpx.get(d.url or "")
        assert got.status_code == 200 and _png_size(got.content) == (32, 32)

    metrics = httpx.get(server.url + "/metrics").text
    assert _metric(metrics, "kvbridge_edge_bytes_total", from_stage="0", to_stage="1", what="kv") > 0
    assert _metric(metrics, "kvbridge_stage_latency_seconds_count", stage="1") >= 5
    ok = _metric(metrics, "kvbridge_http_requests_total", endpoint="/v1/images/generations", status="200")
    assert ok == 4
    assert _metric(metrics, "kvbridge_stage_up", stage="0") == 1.0


def test_bad_requests_are_4xx_with_a_message(server: Server) -> None:
    url = server.url + "/v1/images/generations"
    r = httpx.post(url, content=b'{"prompt": "a cat",', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": MODEL_NAME})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "a cat", "colour": "red"})
    assert r.status_code == 400 and "colour" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "a cat", "size": "1024x1024"})
    assert r.status_code == 400 and "32x32" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(server).images.generate(model="gpt-image-1", prompt="a cat")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        _client(server).images.generate(model=MODEL_NAME, prompt="word " * 600)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello"})
    assert r.status_code == 400 and "images" in r.json()["error"]["message"]
    # the server is still healthy after all that
    assert httpx.get(server.url + "/health").status_code == 200


def test_guidance_per_request_through_the_image_api(server: Server) -> None:
    """guidance_scale / negative_prompt reach the pipeline: the LLM stage computes the negative
    prompt's KV as a companion and the DiT mixes both branches (this config's default is 1)."""
    client = _client(server)

    def png(**extra: object) -> bytes:
        res = client.images.generate(model=MODEL_NAME, prompt="A cute cat", extra_body=extra or None)
        return base64.b64decode(res.data[0].b64_json or "")

    plain = png()
    guided = png(guidance_scale=4.0, negative_prompt="blurry")
    assert _png_size(guided) == (32, 32) and guided != plain
    assert png(guidance_scale=4.0, negative_prompt="blurry") == guided  # deterministic
    assert png(guidance_scale=4.0, negative_prompt="a sharp photo") != guided  # the companion matters
    assert png(guidance_scale=1.0, negative_prompt="blurry") == plain  # 1 = off: no companion
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "a cat", "guidance_scale": -1})
    assert r.status_code == 400 and "guidance_scale" in r.json()["error"]["message"]


def test_32_concurrent_clients(server: Server) -> None:
    results: list[object] = [None] * 32

    def one(i: int) -> None:
        try:
            r = httpx.post(
                server.url + "/v1/images/generations",
                json={"prompt": f"picture number {i}", "num_steps": 2},
                timeout=120,
            )
            results[i] = (r.status_code, _png_size(base64.b64decode(r.json()["data"][0]["b64_json"])))
        except Exception as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert results == [(200, (32, 32))] * 32
    state = httpx.get(server.url + "/debug/state").json()
    assert state["in_flight"] == 0


def test_disconnecting_clients_leave_nothing_behind(server: Server) -> None:
    def one(i: int) -> None:
        # many denoise steps: the requests queue in the diffusion stage, then the client leaves
        try:
            httpx.post(
                server.url + "/v1/images/generations",
                json={"prompt": f"leaving {i}", "num_steps": 400},
                timeout=0.6 + 0.1 * i,
            )
        except httpx.TimeoutException:
            pass

    before = httpx.get(server.url + "/metrics").text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)

    def settled() -> dict | None:
        s = httpx.get(server.url + "/debug/state").json()
        return s if s["in_flight"] == 0 and not s["shm_published"] else None

    state = wait_for(settled, 30)
    assert state, httpx.get(server.url + "/debug/state").json()
    after = httpx.get(server.url + "/metrics").text

    def delta(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    gone = delta("kvbridge_request_failures_total", reason="client_disconnect")
    # Every request the server took in and never answered (499: the client left first) is
    # counted as a disconnect. How many that is depends on the machine's load (a client may
    # give up before the server reads its request, or be served first), so the count is
    # checked against the server's own, not against a fixed number.
    left = delta("kvbridge_http_requests_total", endpoint="/v1/images/generations", status="499")
    assert gone == left and gone >= 1, (gone, left)
    # and the server still serves
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "still here"}, timeout=60)
    assert r.status_code == 200


def test_killed_stage_is_restarted_then_sigterm_cleans_up(server: Server) -> None:
    """A stage killed on an idle server is restarted by the supervisor (the default
    ``runtime.max_restarts``); what each state looks like meanwhile is tested, held at
    gates, in test_serve_supervision.py."""
    health = httpx.get(server.url + "/health").json()
    run_id = httpx.get(server.url + "/debug/state").json()["run_id"]
    stage_pids = {s["stage_id"]: s["pid"] for s in health["stages"]}
    os.kill(stage_pids[1], signal.SIGKILL)

    def back() -> dict | None:
        h = httpx.get(server.url + "/health").json()
        return h if h["status"] == "ok" and h["stages"][1]["pid"] != stage_pids[1] else None

    body = wait_for(back, 60)
    assert body is not None, httpx.get(server.url + "/health").json()
    assert body["stages"][1]["restarts"] == 1 and body["stages"][0]["pid"] == stage_pids[0]
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
    assert r.status_code == 200, r.text
    metrics = httpx.get(server.url + "/metrics").text
    assert _metric(metrics, "kvbridge_stage_restarts_total", stage="1") == 1.0
    assert _metric(metrics, "kvbridge_stage_up", stage="1") == 1.0
    stage_pids[1] = body["stages"][1]["pid"]

    assert stop(server, signal.SIGTERM, timeout_s=60) == 0, server.log()
    assert "[serve] stopped" in server.log()
    for pid in stage_pids.values():  # every stage's process group is gone (zombies aside)
        assert wait_for(lambda pid=pid: not group_alive(pid), 10), group_alive(pid)
    assert shm_names(run_id) == []
    assert json.dumps(body)  # the health body is plain JSON
