"""``vllm-kvbridge serve`` in front of thinker -> talker (async chunk): text endpoints.

One real server for the module (two vLLM engines); completions, chat completions,
streaming (SSE), text-endpoint errors, and a graceful SIGTERM with requests in flight.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from serve_fixtures import ROOT, Server, group_alive, shm_names, start_serve, stop, wait_for

from vllm_kvbridge.models.tiny_llama import ensure_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]
CONFIG = ROOT / "stage_configs/thinker_talker_async_chunk.yaml"
MODEL_NAME = "thinker_talker_async_chunk"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("serve-thinker-talker")
    srv = start_serve(CONFIG, tmp, ensure_tiny_model())
    try:
        yield srv
    finally:
        stop(srv)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_completions_chat_and_streaming(server: Server) -> None:
    client = _client(server)
    res = client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=6)
    text = res.choices[0].text
    assert isinstance(text, str) and text
    assert res.usage is not None and res.usage.prompt_tokens > 0 and 0 < res.usage.completion_tokens <= 8
    assert res.choices[0].finish_reason in ("stop", "length")
    # greedy sampling in both stages: the same prompt gives the same text
    again = client.completions.create(model=MODEL_NAME, prompt="Hello, my name is", max_tokens=6)
    assert again.choices[0].text == text

    stream = client.completions.create(
        model=MODEL_NAME, prompt="Hello, my name is", max_tokens=6, stream=True
    )
    chunks = list(stream)
    assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].text for c in chunks) == text

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say something"}], max_tokens=6
    )
    content = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and isinstance(content, str) and content
    chat_stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say something"}], max_tokens=6, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in chat_stream]
    assert "".join(pieces) == content

    metrics = httpx.get(server.url + "/metrics").text
    assert 'kvbridge_edge_bytes_total{from_stage="0",to_stage="1",what="payload"}' in metrics


def test_text_endpoint_errors(server: Server) -> None:
    client = _client(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="davinci-002", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        client.completions.create(model=MODEL_NAME, prompt="word " * 600)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 400 and "completions" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_finishes_or_aborts_in_flight_requests(server: Server) -> None:
    health = httpx.get(server.url + "/health").json()
    run_id = httpx.get(server.url + "/debug/state").json()["run_id"]
    statuses: list[object] = [None] * 6
    started = threading.Barrier(7)

    def one(i: int) -> None:
        started.wait()
        try:
            r = httpx.post(
                server.url + "/v1/completions",
                json={"model": MODEL_NAME, "prompt": f"request {i}", "max_tokens": 8},
                timeout=60,
            )
            statuses[i] = r.status_code
        except httpx.HTTPError as exc:
            statuses[i] = type(exc).__name__

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.3)  # the requests are in flight
    os.kill(server.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    code = stop(server, signal.SIGTERM, timeout_s=60)
    assert code == 0, server.log()
    # each request was either served or answered 503 (never left hanging)
    assert all(s in (200, 503) for s in statuses), statuses
    for s in health["stages"]:  # every stage's process group is gone (zombies aside)
        assert wait_for(lambda pid=s["pid"]: not group_alive(pid), 10), group_alive(s["pid"])
    assert shm_names(run_id) == []
