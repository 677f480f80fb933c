"""Helpers of the serve tests: start ``vllm-kvbridge serve`` (or ``vllm serve``) as a real
subprocess on a free loopback port, wait for it, stop it, and look for leftovers; or serve
the real app in this process over a pipeline that is never started (:func:`serve_unstarted`),
for what the HTTP layer decides before a request reaches a stage."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from vllm_kvbridge.pipeline.stage_handles import kill_stage_group, shm_mapped_by_group

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent
SERVER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
}


class Gates:
    """Files under ``path`` that test fixtures in the stage processes poll (e.g. ``hold``:
    keep requests in the stage until the file goes), so a test decides when work proceeds."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def set(self, name: str, on: bool) -> None:
        f = self.path / name
        f.touch() if on else f.unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path
    #: httpx's ``verify`` for this server (an SSL context trusting a self-signed server)
    verify: Any = True

    def http(self, headers: dict[str, str] | None = None, timeout: float = 120) -> httpx.Client:
        """An httpx client for this server (TLS-verified against its certificate)."""
        return httpx.Client(base_url=self.url, verify=self.verify, headers=headers, timeout=timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""


def start_process(
    argv: list[str], log_path: Path, url: str, health: str, timeout_s: float, verify: Any = True
) -> Server:
    """Start ``argv`` in its own session; wait until ``GET url+health`` answers 200
    (``verify``: httpx's, e.g. the CA file of a self-signed server)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SERVER_ENV},
            start_new_session=True,
        )
    server = Server(proc, url, log_path, verify)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[:4]} exited with {proc.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + health, timeout=2, verify=verify).status_code == 200:
                return server
        time.sleep(0.5)
    stop(server)
    raise RuntimeError(f"{argv[:4]} not healthy after {timeout_s} s:\n{server.log()}")


def start_serve(
    config: str | Path,
    tmp: Path,
    model: str | Path,
    *extra: str,
    timeout_s: float = 300,
    tls: tuple[Path, Path] | None = None,
    debug_endpoints: bool = True,
) -> Server:
    """``vllm-kvbridge serve`` on a free port; ``tls``: (key, certificate) PEM files -> HTTPS.
    ``debug_endpoints``: pass ``--debug-endpoints`` (the tests read ``/debug/state`` and the
    stages' pids in ``/health``, which a server without a key hides by default)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm_kvbridge.cli.main", "serve",
        "--stage-config", str(config), "--port", str(port), "--model", str(model),
        "--output-dir", str(tmp / "images"), "--log-dir", str(tmp / "logs"), "--drain-timeout", "5",
        *(["--debug-endpoints"] if debug_endpoints else []), *extra,
    ]  # fmt: skip
    scheme, verify = "http", True
    if tls is not None:
        argv += ["--ssl-keyfile", str(tls[0]), "--ssl-certfile", str(tls[1])]
        scheme, verify = "https", ssl.create_default_context(cafile=str(tls[1]))
    server = start_process(
        argv, tmp / "serve.log", f"{scheme}://127.0.0.1:{port}", "/health", timeout_s, verify
    )
    assert list((tmp / "logs").glob("stage_*.log"))  # --log-dir: the stages log there
    return server


@contextlib.contextmanager
def serve_edited(
    config: Path, tmp: Path, model: str | Path, edit: Callable[[dict[str, Any]], None]
) -> Iterator[Server]:
    """Serve a copy of the stage config ``config`` that ``edit`` changed (the parsed YAML, in
    place); stopped on exit."""
    spec = yaml.safe_load(config.read_text())
    edit(spec)
    edited = tmp / config.name
    edited.write_text(yaml.safe_dump(spec))
    srv = start_serve(edited, tmp, model)
    try:
        yield srv
    finally:
        stop(srv)


@dataclass
class AppServer:
    """The real app under uvicorn in this process (:func:`serve_unstarted`)."""

    url: str
    state: Any  # the app's ``ServerState`` (its ``service`` is real, its stages never start)


@contextlib.contextmanager
def serve_unstarted(
    config: str | Path, model: str | Path, *, max_in_flight: int = 2, **app_kwargs: Any
) -> Iterator[AppServer]:
    """Serve ``build_app`` (``app_kwargs``: its options) with uvicorn on a free loopback port,
    in a thread of this process, over a real :class:`PipelineService` whose pipeline is never
    started: no stage process or engine, so a request the server hands to it stays in flight
    until the server stops. For what the server must decide before that (limits, validation,
    authentication, admission); the model's tokenizer does the prompt-length checks."""
    import threading

    import uvicorn
    from transformers import AutoTokenizer

    from vllm_kvbridge.pipeline import Pipeline
    from vllm_kvbridge.pipeline.service import PipelineService
    from vllm_kvbridge.server.app import ServerState, build_app

    pipe = Pipeline.from_config(config, model=str(model))
    service = PipelineService(pipe, max_in_flight=max_in_flight)
    state = ServerState(
        service, served_model_name=pipe.plan.name, tokenizer=AutoTokenizer.from_pretrained(str(model))
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_app(state, **app_kwargs), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="serve-unstarted", daemon=True)
    thread.start()
    try:
        if not wait_for(lambda: server.started or not thread.is_alive(), 60) or not server.started:
            raise RuntimeError("uvicorn did not start")
        yield AppServer(f"http://127.0.0.1:{port}", state)
    finally:
        service.close()  # fails whatever is in flight, so no handler waits past the exit
        server.should_exit = True
        thread.join(timeout=30)
        pipe.close()


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A key and a self-signed certificate for 127.0.0.1 (openssl), valid one day."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, cert


def stop(server: Server, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int | None:
    """Signal the server; SIGKILL its whole group if it has not exited in ``timeout_s``.

    A killed vLLM engine cannot remove its own shared-memory segments (vLLM's ``psm_*``
    message queues, hundreds of MB), so the segments the group mapped are unlinked
    once nothing maps them any more.
    """
    mapped = shm_mapped_by_group(server.proc.pid) if server.proc.poll() is None else set()
    if server.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=timeout_s)
    code = server.proc.poll()
    kill_stage_group(server.proc.pid, mapped, wait_s=10)
    server.proc.wait(timeout=10)
    return code


def shm_names(run_id: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvbridge.{run_id}"))


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value (returned) or the time is up (last value)."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value


def post_images(srv: Server, n: int, prompt: str = "a cat") -> tuple[list[Any], list[httpx.Response]]:
    """``n`` image requests posted from background threads (started); their answers, in
    arrival order, once the threads are joined."""
    import threading

    answers: list[httpx.Response] = []

    def post(i: int) -> None:
        body = {"prompt": f"{prompt} {i}"}
        answers.append(httpx.post(srv.url + "/v1/images/generations", json=body, timeout=300))

    threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, answers


def metric(srv: Server, name: str, **labels: str) -> float:
    """The sum of the server's Prometheus series ``name`` over those with ``labels``."""
    total = 0.0
    for line in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
