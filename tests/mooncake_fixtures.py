"""A real ``mooncake_master`` (with its embedded HTTP metadata server) for tests.

:class:`MooncakeMaster` starts the binary from the venv on free loopback ports, waits
until its RPC port, metadata server and admin endpoint answer, and stops it by pid. The
process gets ``PR_SET_PDEATHSIG`` so it dies with the test process that started it even
when that process is killed (forked tests exit with ``os._exit``).

The ``mooncake_master`` fixture is function-scoped on purpose: tests run ``--forked``,
and a session fixture would be set up again (and never torn down) in every forked child.
It also exports the addresses as ``KVB_TEST_MOONCAKE_*`` environment variables, which
spawned children inherit and connector configs reference as ``${KVB_TEST_MOONCAKE_MASTER}``.

Imports nothing from Mooncake's Python binding: only the master binary is used here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ENV_MASTER = "KVB_TEST_MOONCAKE_MASTER"
ENV_METADATA = "KVB_TEST_MOONCAKE_METADATA"
ENV_ADMIN = "KVB_TEST_MOONCAKE_ADMIN"
_PR_SET_PDEATHSIG = 1


def master_binary() -> Path:
    """``mooncake_master`` next to this interpreter (the venv's bin/)."""
    path = Path(sys.executable).parent / "mooncake_master"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: install the [mooncake] extra "
                                "(mooncake-transfer-engine-non-cuda)")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class MooncakeMaster:
    """One ``mooncake_master`` process on loopback; ports stay fixed across restarts."""

    workdir: Path
    rpc_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def config(self, **overrides: Any) -> dict[str, Any]:
        """A MooncakeStoreConnector config pointing at this master."""
        return {"master_server_address": self.master_address, "metadata_server": self.metadata_server,
                "local_hostname": "127.0.0.1", "global_segment_size": 256 << 20,
                "local_buffer_size": 16 << 20, "protocol": "tcp", **overrides}

    def start(self, timeout: float = 30.0) -> None:
        log = open(self.workdir / "master.log", "ab")  # noqa: SIM115 - the child owns it from here
        args = [str(master_binary()), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true", f"--http_metadata_server_port={self.http_port}",
                "--http_metadata_server_host=127.0.0.1", f"--metrics_port={self.admin_port}",
                "--metrics_host=127.0.0.1", "--rpc_thread_num=2", "--logtostderr", *self.extra_args]
        deadline = time.monotonic() + timeout
        # A just-stopped master's ports can take a moment to become bindable again.
        while any(_port_open(p) for p in (self.rpc_port, self.http_port, self.admin_port)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ports of {self} are still in use")
            time.sleep(0.1)
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         cwd=self.workdir, preexec_fn=_die_with_parent)
        finally:
            log.close()
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master did not answer within {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def ready(self) -> bool:
        """RPC port accepts, the metadata server answers HTTP, the admin endpoint says healthy."""
        if not (_port_open(self.rpc_port) and _port_open(self.http_port)):
            return False
        try:
            with urllib.request.urlopen(f"{self.admin_url}/health", timeout=1) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop by pid (``sig``, then SIGKILL after ``timeout``); idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, sig)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Crash the master (SIGKILL): no chance to say goodbye to clients."""
        self.stop(signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key the master knows (admin ``/get_all_keys``) starting with ``prefix``."""
        with urllib.request.urlopen(f"{self.admin_url}/get_all_keys", timeout=5) as resp:
            text = resp.read().decode()
        return sorted(k for k in text.splitlines() if k and k.startswith(prefix))

    def metric(self, name: str) -> float:
        """One gauge/counter from the admin ``/metrics`` (Prometheus text)."""
        with urllib.request.urlopen(f"{self.admin_url}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] == name:
                    return float(parts[1])
        raise KeyError(name)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join((self.workdir / "master.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "<no log>"

    def export_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(ENV_MASTER, self.master_address)
        monkeypatch.setenv(ENV_METADATA, self.metadata_server)
        monkeypatch.setenv(ENV_ADMIN, self.admin_url)


def keys_in_env_master(prefix: str) -> list[str]:
    """Keys under ``prefix`` on the master named by ``$KVB_TEST_MOONCAKE_ADMIN`` (works in children)."""
    with urllib.request.urlopen(f"{os.environ[ENV_ADMIN]}/get_all_keys", timeout=5) as resp:
        return sorted(k for k in resp.read().decode().splitlines() if k.startswith(prefix))


def env_config(namespace: str, **overrides: Any) -> dict[str, Any]:
    """Connector config that finds the test master through the environment (``${ENV}`` expansion)."""
    return {"master_server_address": "${" + ENV_MASTER + "}", "metadata_server": "${" + ENV_METADATA + "}",
            "local_hostname": "127.0.0.1", "namespace": namespace, "global_segment_size": "1536MiB",
            "protocol": "tcp", **overrides}


@pytest.fixture
def mooncake_master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A running master for one test; stopped by pid afterwards (and dies with the test process)."""
    master = MooncakeMaster(tmp_path)
    master.start()
    master.export_env(monkeypatch)
    try:
        yield master
    finally:
        master.stop()


__all__ = ["MooncakeMaster", "env_config", "free_port", "keys_in_env_master", "mooncake_master"]
