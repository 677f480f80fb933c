"""Start and stop a local ``mooncake_master`` (with its embedded HTTP metadata server).

The one launcher of the package: the tests' fixture, the connector benchmark and
``vllm-kvbridge run --start-mooncake-master`` all use :class:`MooncakeMaster`. On a real
multi-host deployment the master is a long-lived service started by hand (see
``docs/multi_host.md``; :meth:`MooncakeMaster.command` prints the equivalent command).

Contract:

* :func:`master_binary` finds ``mooncake_master`` next to the running interpreter (a
  venv's ``bin/``, where the ``[mooncake]`` extra installs it), else on ``PATH``;
  :class:`FileNotFoundError` names the extra to install when there is none.
* :meth:`MooncakeMaster.start` binds the RPC port, the HTTP metadata server and the
  admin/metrics endpoint on ``host`` (ports chosen free on that host unless given) and
  returns once all three answer (RPC accepts TCP, the metadata server speaks HTTP, the
  admin ``/health`` says 200). A master that exits or stays silent past ``timeout`` is a
  :class:`RuntimeError` carrying the tail of its log, and nothing is left running. When
  the ports were chosen here and another process took one in the meantime, start picks
  new ones and tries again.
* The process runs in its own process group (a Ctrl-C in the terminal reaches the
  caller, which stops the master in order) and, on Linux, gets ``PR_SET_PDEATHSIG`` so a
  caller killed without cleanup (SIGKILL, a forked test's ``os._exit``) does not leave it
  behind (the signal follows the *thread* that started it: start it from a thread that
  outlives it, normally the main thread, or pass ``die_with_parent=False``).
  :meth:`MooncakeMaster.stop` sends SIGTERM to the group, SIGKILL after a grace period,
  and is idempotent; leaving the ``with`` block stops it and removes its temporary log
  directory (:meth:`~MooncakeMaster.close`). Ports stay fixed across
  :meth:`~MooncakeMaster.stop` / :meth:`~MooncakeMaster.start`, so connected clients
  reconnect by themselves to a restarted master.
* Observation goes through the admin endpoint: :meth:`MooncakeMaster.keys` (every object
  key, ``/get_all_keys``) and :meth:`MooncakeMaster.metric` (``/metrics``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: Environment variables the shipped stage configs read the addresses from
#: (``${KVB_MOONCAKE_MASTER:-127.0.0.1:50051}`` ...); :meth:`MooncakeMaster.env` fills them.
ENV_PREFIX = "KVB_MOONCAKE"
BINARY = "mooncake_master"
_PR_SET_PDEATHSIG = 1
_START_ATTEMPTS = 3


def master_binary() -> Path:
    """``mooncake_master`` next to this interpreter (a venv's ``bin/``), else on ``PATH``."""
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    raise FileNotFoundError(
        f"{BINARY} is neither next to {sys.executable} nor on PATH: install the 'mooncake' extra "
        "(pip install 'vllm-kvbridge[mooncake]', or '[mooncake-cuda]' on GPU hosts)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on at ``host`` right now (the kernel's pick)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _bindable(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (SO_REUSEADDR, as servers do, so a
    closed connection's TIME_WAIT does not count; a listener does)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class MooncakeMaster:
    """One ``mooncake_master`` process with its HTTP metadata server; see the module docstring.

    ``host`` is the address it binds and advertises (``127.0.0.1`` for a one-host run; a
    reachable interface address when other hosts use it). Ports default to free ones.
    ``log_dir`` receives ``mooncake_master.log`` (default: a temporary directory removed
    by :meth:`close`). ``extra_args`` are appended to the command line (e.g.
    ``("--default_kv_lease_ttl=2000",)``).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int | None = None,
        http_port: int | None = None,
        admin_port: int | None = None,
        log_dir: str | Path | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        binary: str | Path | None = None,
        die_with_parent: bool = True,
    ) -> None:
        self.host = host
        self._auto_ports = rpc_port is None and http_port is None and admin_port is None
        self.rpc_port = rpc_port or free_port(host)
        self.http_port = http_port or free_port(host)
        self.admin_port = admin_port or free_port(host)
        self._own_log_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.extra_args = tuple(extra_args)
        self.binary = Path(binary) if binary is not None else None
        self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
        self.proc: subprocess.Popen | None = None
        self._returncode: int | None = None
        self._served = False  # a master has answered on these ports

    # -- addresses ----------------------------------------------------------------------
    @property
    def _probe_host(self) -> str:
        # Bound to every interface: this host reaches it on loopback.
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def master_address(self) -> str:
        """``host:rpc_port``: the connector's ``master_server_address``."""
        return f"{self._probe_host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """``http://host:http_port/metadata``: the connector's ``metadata_server``."""
        return f"http://{self._probe_host}:{self.http_port}/metadata"

    @property
    def admin_url(self) -> str:
        return f"http://{self._probe_host}:{self.admin_port}"

    @property
    def log_path(self) -> Path | None:
        return self.log_dir / "mooncake_master.log" if self.log_dir is not None else None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def connector_config(self, **overrides: Any) -> dict[str, Any]:
        """A ``MooncakeStoreConnector`` config pointing at this master (TCP, this host)."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": self._probe_host,
            "global_segment_size": 256 << 20,
            "local_buffer_size": 16 << 20,
            "protocol": "tcp",
            **overrides,
        }

    def env(self, prefix: str = ENV_PREFIX) -> dict[str, str]:
        """``{PREFIX_MASTER, PREFIX_METADATA, PREFIX_ADMIN}``: addresses for ``${ENV}`` configs."""
        return {
            f"{prefix}_MASTER": self.master_address,
            f"{prefix}_METADATA": self.metadata_server,
            f"{prefix}_ADMIN": self.admin_url,
        }

    def command(self) -> list[str]:
        """The command line :meth:`start` runs."""
        return [
            str(self.binary or master_binary()),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_port={self.http_port}",
            f"--http_metadata_server_host={self.host}",
            f"--metrics_port={self.admin_port}",
            f"--metrics_host={self.host}",
            "--rpc_thread_num=2",  # the default (16) is far more than a local run needs
            "--logtostderr",
            *self.extra_args,
        ]

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        """Start the master and wait until it answers (see the module docstring). Returns self."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="kvbridge-mooncake-master-"))
        log_dir = self.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        # Ports picked here may be re-picked until a master has served on them; after that
        # they are this master's (a restart must come back where its clients look for it).
        repick = self._auto_ports and not self._served
        for _ in range(_START_ATTEMPTS):
            if repick and self._ports_busy():
                self._repick_ports()
            self._wait_ports_free(deadline)
            if not self._launch(log_dir, deadline):
                self._served = True
                return self
            if not repick:
                break
            # Most likely a port was taken between free_port() and bind: pick new ones.
            self._repick_ports()
        raise RuntimeError(f"{BINARY} exited with {self._returncode}:\n{self.log_tail()}")

    def _ports_busy(self) -> bool:
        return not all(_bindable(self.host, p) for p in (self.rpc_port, self.http_port, self.admin_port))

    def _repick_ports(self) -> None:
        self.rpc_port, self.http_port, self.admin_port = (free_port(self.host) for _ in range(3))

    def _wait_ports_free(self, deadline: float) -> None:
        # A just-stopped master's ports can take a moment to become bindable again.
        while self._ports_busy():
            if time.monotonic() > deadline:
                ports = (self.rpc_port, self.http_port, self.admin_port)
                raise RuntimeError(f"ports {ports} of {BINARY} on {self.host} are still in use")
            time.sleep(0.1)

    def _launch(self, log_dir: Path, deadline: float) -> bool:
        """Start one process and wait for it; True when it exited during start-up."""
        with open(log_dir / "mooncake_master.log", "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=log_dir,
                start_new_session=True,
                preexec_fn=_die_with_parent if self.die_with_parent else None,
            )
        while not self.ready():
            if self.proc.poll() is not None:
                self._returncode = self.proc.returncode
                self.proc = None
                return True
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"{BINARY} did not answer within the start timeout:\n{tail}")
            time.sleep(0.05)
        return False

    def ready(self) -> bool:
        """RPC port accepts, the metadata server answers HTTP, the admin ``/health`` is 200."""
        if not _port_open(self._probe_host, self.rpc_port):
            return False
        url = f"http://{self._probe_host}:{self.http_port}/metadata?key=kvbridge-readiness-probe"
        try:
            with urllib.request.urlopen(url, timeout=1):
                pass
        except urllib.error.HTTPError:
            pass  # an HTTP answer (404 for an unknown key) is all we ask of it
        except OSError:
            return False
        try:
            with urllib.request.urlopen(f"{self.admin_url}/health", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Signal the master's process group (``sig``, SIGKILL after ``timeout``) and reap it.

        Idempotent; the log stays (see :meth:`close`).
        """
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        elif proc is not None:
            proc.wait()

    def close(self) -> None:
        """:meth:`stop`, then remove the temporary log directory (if :meth:`start` made it)."""
        self.stop()
        if self._own_log_dir and self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self.log_dir = None

    def kill(self) -> None:
        """Crash the master (SIGKILL): clients get no goodbye."""
        self.stop(signal.SIGKILL)

    def restart(self, timeout: float = 30.0) -> None:
        """Stop, then start on the same ports (objects stored before are gone)."""
        self.stop()
        self.start(timeout)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.proc.pid}" if self.running() else "stopped"
        return f"MooncakeMaster({self.master_address}, metadata {self.metadata_server}, {state})"

    # -- observation --------------------------------------------------------------------
    def keys(self, prefix: str = "") -> list[str]:
        """Every object key the master holds (admin ``/get_all_keys``) starting with ``prefix``."""
        return keys_at(self.admin_url, prefix)

    def metric(self, name: str) -> float:
        """One gauge/counter from the admin ``/metrics`` (Prometheus text); KeyError if absent."""
        with urllib.request.urlopen(f"{self.admin_url}/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] == name:
                    return float(parts[1])
        raise KeyError(name)

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the master's log (``<no log>`` when there is none)."""
        path = self.log_path
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path else "<no log>"
        except OSError:
            return "<no log>"


def keys_at(admin_url: str, prefix: str = "") -> list[str]:
    """Keys under ``prefix`` held by the master whose admin endpoint is ``admin_url``."""
    with urllib.request.urlopen(f"{admin_url}/get_all_keys", timeout=5) as resp:
        text = resp.read().decode()
    return sorted(k for k in text.splitlines() if k and k.startswith(prefix))


__all__ = ["ENV_PREFIX", "MooncakeMaster", "free_port", "keys_at", "master_binary"]
