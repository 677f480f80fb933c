"""What the HTTP server decides before a request reaches a stage (issue 36, items 3 and 6),
checked on the real app under uvicorn over loopback with the default settings (no API key,
no ``--debug-endpoints``). Its pipeline is real but never started
(:func:`serve_fixtures.serve_unstarted`): no request here may reach a stage, and one that
did would stay in flight, which the tests see in the service's own counters.
The same guarantees on a running pipeline: ``test_serve_hardening.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_fixtures import ROOT, AppServer, serve_unstarted

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.server.limits import DEFAULT_MAX_BODY_BYTES

CONFIG = ROOT / "stage_configs/ar_to_dit_cfg.yaml"
IMAGES = "/v1/images/generations"


@pytest.fixture(scope="module")
def app() -> Iterator[AppServer]:
    with serve_unstarted(CONFIG, ensure_tiny_model(), max_in_flight=2) as srv:
        yield srv


def _openai_error(r: httpx.Response, status: int) -> dict:  # type: ignore[type-arg]
    """The error of ``r``, checked to be OpenAI's body with ``status``."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status
    return body["error"]


def test_debug_state_is_off_without_a_key_or_debug_endpoints(app: AppServer) -> None:
    err = _openai_error(httpx.get(app.url + "/debug/state", timeout=30), 404)
    assert "--debug-endpoints" in err["message"]


def test_a_chunked_body_over_the_limit_is_cut_off_413(app: AppServer) -> None:
    """No Content-Length to refuse up front: the server counts the body as it arrives and
    answers 413 once it passes the limit, while the client is still sending."""
    sent = [0]
    chunk = b" " * 65536

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        while sent[0] < 4 * DEFAULT_MAX_BODY_BYTES:  # the server stops reading long before
            sent[0] += len(chunk)
            yield chunk
        yield b'"}'

    r = httpx.post(app.url + IMAGES, content=body(), headers={"content-type": "application/json"}, timeout=60)
    err = _openai_error(r, 413)
    assert str(DEFAULT_MAX_BODY_BYTES) in err["message"]
    assert app.state.service.in_flight() == 0 and app.state.submitted == 0


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (b'{"prompt": "a cat"', None),  # malformed JSON
        (b'{"prompt": "a \xff cat"}', None),  # not UTF-8
        (b'{"prompt": 5}', "prompt"),
        (b'{"prompt": "a cat", "n": "many"}', "n"),
        (b'{"prompt": "a cat", "negative_prompt": ["x"]}', "negative_prompt"),
        (b'["a cat"]', None),
        (b"", None),
    ],
)
def test_malformed_bodies_get_400_in_openai_shape(app: AppServer, content: bytes, param: str | None) -> None:
    r = httpx.post(
        app.url + IMAGES, content=content, headers={"content-type": "application/json"}, timeout=30
    )
    err = _openai_error(r, 400)
    assert err["param"] == param, err


def test_unknown_paths_and_methods_get_openai_errors(app: AppServer) -> None:
    _openai_error(httpx.get(app.url + "/v1/nothing", timeout=30), 404)
    _openai_error(httpx.get(app.url + IMAGES, timeout=30), 405)


def test_negative_prompt_longer_than_the_context_is_400(app: AppServer) -> None:
    body = {"prompt": "a cat", "guidance_scale": 4.0, "negative_prompt": "blurry " * 2000}
    err = _openai_error(httpx.post(app.url + IMAGES, json=body, timeout=60), 400)
    assert err["param"] == "negative_prompt" and "negative_prompt" in err["message"], err
    assert app.state.service.in_flight() == 0 and app.state.submitted == 0


def test_n_over_the_admission_limit_starts_none_of_its_requests(app: AppServer) -> None:
    r = httpx.post(app.url + IMAGES, json={"prompt": "a cat", "n": 3}, timeout=60)
    err = _openai_error(r, 429)
    assert err["type"] == "rate_limit_exceeded" and r.headers["Retry-After"] == "1", err
    # the service never saw any of the three (max_in_flight 2)
    svc = app.state.service
    assert (svc.in_flight(), svc.high_water) == (0, 0)
    assert app.state.submitted == 0


def test_a_long_prompt_is_tokenized_off_the_event_loop(app: AppServer) -> None:
    """A prompt just under the body limit takes the tokenizer seconds: meanwhile /health
    answers at once (it waits on the same event loop)."""
    uploaded = threading.Event()
    answer: list[httpx.Response] = []
    prompt = b"a cat " * ((DEFAULT_MAX_BODY_BYTES - 100) // 6)

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "' + prompt + b'"}'
        uploaded.set()

    def post() -> None:
        headers = {"content-type": "application/json", "content-length": str(len(prompt) + 14)}
        answer.append(httpx.post(app.url + IMAGES, content=body(), headers=headers, timeout=120))

    t = threading.Thread(target=post)
    t.start()
    assert uploaded.wait(60)
    latencies = []
    while True:  # at least once after the whole prompt is in, until it is answered
        t0 = time.monotonic()
        assert httpx.get(app.url + "/health", timeout=30).status_code == 503  # never started
        latencies.append(time.monotonic() - t0)
        if not t.is_alive():
            break
        time.sleep(0.05)
    t.join()
    err = _openai_error(answer[0], 400)
    assert "maximum context length" in err["message"]
    assert max(latencies) < 1.0, latencies
