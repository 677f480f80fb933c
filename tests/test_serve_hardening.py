"""``vllm-kvbridge serve`` under hostile or careless clients (issue 36, items 3 and 6): one
real server for the module (a subprocess on loopback, AR -> DiT with guidance, an API key,
``--max-in-flight 2``), driven over real HTTP.

* A body over ``--max-body-bytes`` is answered 413 without being read, and a prompt under
  it is tokenized off the event loop: neither stalls ``/health``.
* Every text field the model reads is length-checked (``negative_prompt`` too) and every
  error is OpenAI's error body.
* An ``n``-image request is admitted or refused as a whole.
* The key: any case of the ``Bearer`` scheme; the stages' pids in ``/health`` and
  ``/debug/state`` only for a caller that presents it.

What the server decides before a request reaches a stage, with the default settings (no
key): ``test_serve_http_limits.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_fixtures import ROOT, Server, start_serve, stop, wait_for

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "the module's server (vLLM engine + DiT) starts in its first test"),
]
CONFIG = ROOT / "stage_configs/ar_to_dit_cfg.yaml"
IMAGES = "/v1/images/generations"
KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: /health must answer within this while another request is read or tokenized (the acceptance bound).
HEALTH_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("serve-hardening")
    srv = start_serve(
        CONFIG, tmp, ensure_tiny_model(), "--api-key", KEY, "--max-in-flight", "2", debug_endpoints=False
    )
    try:
        yield srv
    finally:
        stop(srv)


def _openai_error(r: httpx.Response, status: int) -> dict:  # type: ignore[type-arg]
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _health_while(server: Server, busy: threading.Thread) -> list[float]:
    """Seconds each ``GET /health`` took, from now until ``busy`` ends (at least one)."""
    latencies = []
    with server.http(timeout=60) as client:
        while True:
            t0 = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            if not busy.is_alive():
                return latencies
            time.sleep(0.05)


def _post_streamed(server: Server, data: bytes, answers: list[httpx.Response]) -> threading.Event:
    """POST ``data`` (declared by its Content-Length) from a thread; the event is set once
    the whole body was handed to the socket."""
    sent = threading.Event()

    def body() -> Iterator[bytes]:
        for i in range(0, len(data), 1 << 20):
            yield data[i : i + (1 << 20)]
        sent.set()

    def post() -> None:
        headers = {**AUTH, "content-type": "application/json", "content-length": str(len(data))}
        with server.http(timeout=300) as client:
            answers.append(client.post(IMAGES, content=body(), headers=headers))

    threading.Thread(target=post, name="big-post", daemon=True).start()
    return sent


def test_a_20_mb_body_is_refused_413_and_health_keeps_answering(server: Server) -> None:
    data = b'{"prompt": "' + b"a cat " * (20_000_000 // 6) + b'"}'
    answers: list[httpx.Response] = []
    sent = _post_streamed(server, data, answers)
    busy = threading.Thread(target=lambda: sent.wait(120) and time.sleep(3))
    busy.start()
    latencies = _health_while(server, busy)  # while it uploads and just after
    assert sent.is_set()
    assert max(latencies) < HEALTH_S, latencies
    assert wait_for(lambda: answers, 120)
    err = _openai_error(answers[0], 413)
    assert "too large" in err["message"] and "4194304" in err["message"], err


def test_a_long_prompt_under_the_limit_does_not_stall_health(server: Server) -> None:
    """About 3.5 MB of prompt takes the tokenizer seconds; it is too long for the model (400),
    and /health answers meanwhile."""
    data = b'{"prompt": "' + b"a cat " * 600_000 + b'"}'
    answers: list[httpx.Response] = []
    sent = _post_streamed(server, data, answers)
    assert sent.wait(120)
    busy = threading.Thread(target=wait_for, args=(lambda: answers, 120))
    busy.start()
    latencies = _health_while(server, busy)
    assert max(latencies) < HEALTH_S, latencies
    err = _openai_error(answers[0], 400)
    assert "maximum context length" in err["message"] and err["param"] == "prompt", err


def test_a_negative_prompt_longer_than_the_context_is_400(server: Server) -> None:
    body = {"prompt": "a cat", "guidance_scale": 4.0, "negative_prompt": "blurry " * 2000}
    r = server.http(AUTH).post(IMAGES, json=body)
    err = _openai_error(r, 400)
    assert err["param"] == "negative_prompt" and "in the negative_prompt" in err["message"], err
    # a short one is run (guided image)
    body["negative_prompt"] = "blurry"
    r = server.http(AUTH).post(IMAGES, json=body)
    assert r.status_code == 200 and r.json()["data"][0]["b64_json"], r.text


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'{"prompt": "a cat"', None),  # malformed JSON
        (b'{"prompt": "a \xff cat"}', None),  # not UTF-8
        (b'{"prompt": ["a cat"]}', "prompt"),
        (b'{"prompt": "a cat", "n": "two"}', "n"),
    ],
)
def test_malformed_bodies_get_400_in_openai_shape(server: Server, content: bytes, param: str | None) -> None:
    headers = {**AUTH, "content-type": "application/json"}
    err = _openai_error(server.http(headers).post(IMAGES, content=content), 400)
    assert err["param"] == param, err


def test_n_images_are_admitted_or_refused_as_a_whole(server: Server) -> None:
    keyed = server.http(AUTH)
    before = keyed.get("/debug/state").json()
    r = keyed.post(IMAGES, json={"prompt": "a cat", "n": 3})  # max_in_flight is 2
    err = _openai_error(r, 429)
    assert err["type"] == "rate_limit_exceeded" and r.headers["Retry-After"] == "1", err
    after = keyed.get("/debug/state").json()
    # none of the three reached the pipeline (the earlier tests ran one request at a time)
    assert after["in_flight_high_water"] < 2 and after["in_flight"] == 0, after
    assert after["submitted"] == before["submitted"], (before, after)
    r = keyed.post(IMAGES, json={"prompt": "a cat", "n": 2})  # fits: both run
    assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text
    assert keyed.get("/debug/state").json()["submitted"] == before["submitted"] + 2


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_auth_scheme_is_case_insensitive(server: Server, scheme: str) -> None:
    assert server.http({"Authorization": f"{scheme} {KEY}"}).get("/v1/models").status_code == 200
    r = server.http({"Authorization": f"{scheme} not-{KEY}"}).get("/v1/models")
    assert _openai_error(r, 401)["type"] == "authentication_error"


def test_health_shows_pids_only_to_a_caller_with_the_key(server: Server) -> None:
    anonymous = server.http().get("/health")
    assert anonymous.status_code == 200 and anonymous.json()["status"] == "ok", anonymous.text
    stages = anonymous.json()["stages"]
    assert [s["status"] for s in stages] == ["ready", "ready"] and not [s for s in stages if "pid" in s]
    keyed = server.http(AUTH).get("/health").json()["stages"]
    assert all(isinstance(s["pid"], int) and s["pid"] > 0 for s in keyed), keyed
    # a wrong key on the open path is no key
    wrong = server.http({"Authorization": "Bearer nope"}).get("/health")
    assert wrong.status_code == 200 and not [s for s in wrong.json()["stages"] if "pid" in s]


def test_debug_state_needs_the_key(server: Server) -> None:
    _openai_error(server.http().get("/debug/state"), 401)
    _openai_error(server.http({"Authorization": "bearer nope"}).get("/debug/state"), 401)
    state = server.http({"Authorization": f"bearer {KEY}"}).get("/debug/state")
    assert state.status_code == 200 and "requests" in state.json(), state.text
