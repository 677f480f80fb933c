"""The package's ``mooncake_master`` launcher (:mod:`vllm_kvbridge.connectors.mooncake_master`).

Real master processes on loopback; every test checks that nothing is left running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_kvbridge.connectors import mooncake_master as mm
from vllm_kvbridge.connectors.mooncake_master import MooncakeMaster, master_binary

pytestmark = [pytest.mark.forked, pytest.mark.mooncake]


def _gone(pid: int, within: float = 10.0) -> bool:
    """True once ``pid`` no longer exists (or is a zombie nobody reaps yet)."""
    until = time.monotonic() + within
    while time.monotonic() < until:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def _children() -> list[int]:
    """Live (non-zombie) child processes of this test process."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                found.append(int(entry))
    return found


def test_context_manager_serves_on_loopback_and_cleans_up():
    with MooncakeMaster() as master:
        pid = master.pid
        assert master.running() and master.ready()
        assert master.master_address == f"127.0.0.1:{master.rpc_port}"
        assert master.metadata_server == f"http://127.0.0.1:{master.http_port}/metadata"
        assert master.keys() == [] and master.metric("master_key_count") == 0
        with pytest.raises(KeyError):
            master.metric("no_such_metric")
        assert os.getpgid(pid) == pid  # its own process group
        env = master.env()
        assert env["KVB_MOONCAKE_MASTER"] == master.master_address
        assert env["KVB_MOONCAKE_METADATA"] == master.metadata_server
        cfg = master.connector_config(namespace="x")
        assert cfg["master_server_address"] == master.master_address and cfg["namespace"] == "x"
        log_dir = master.log_dir
        assert "master" in master.log_tail().lower()
        assert master.command()[0] == str(master_binary())
    assert _gone(pid) and not master.running()
    assert not log_dir.exists()  # its temporary log directory went with it
    master.close()  # idempotent
    master.stop()
    assert _children() == []


def test_stop_then_start_keeps_the_ports(tmp_path: Path):
    master = MooncakeMaster(log_dir=tmp_path)
    try:
        master.start()
        ports, first = (master.rpc_port, master.http_port, master.admin_port), master.pid
        master.restart()
        assert (master.rpc_port, master.http_port, master.admin_port) == ports
        assert master.pid != first and _gone(first) and master.ready()
        master.kill()
        assert not master.running()
    finally:
        master.close()
    assert (tmp_path / "mooncake_master.log").exists()  # a caller's log dir is kept
    assert _children() == []


def test_a_taken_port_is_picked_again():
    master = MooncakeMaster()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", master.rpc_port))
        squatter.listen(1)
        taken = master.rpc_port
        with master:
            assert master.rpc_port != taken and master.ready()
    assert _children() == []


def test_explicit_port_in_use_is_a_clear_error(tmp_path: Path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="still in use"):
            MooncakeMaster(rpc_port=port, log_dir=tmp_path).start(timeout=1.0)
        assert time.monotonic() - start < 5
    assert _children() == []


def test_master_that_exits_at_start_is_an_error_with_its_log(tmp_path: Path):
    master = MooncakeMaster(log_dir=tmp_path, extra_args=("--no_such_flag_kvbridge=1",))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with") as err:
        master.start(timeout=20)
    assert "no_such_flag_kvbridge" in str(err.value)  # the master's own complaint
    assert time.monotonic() - start < 15 and not master.running()
    assert _children() == []


def test_master_that_never_answers_times_out_and_is_killed(tmp_path: Path):
    silent = tmp_path / "silent_master"
    silent.write_text("#!/bin/sh\necho 'pretending to start'\nexec sleep 60\n")
    silent.chmod(0o755)
    master = MooncakeMaster(log_dir=tmp_path, binary=silent)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer") as err:
        master.start(timeout=1.5)
    assert "pretending to start" in str(err.value)
    assert time.monotonic() - start < 8 and not master.running()
    assert _children() == []


def test_binary_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert master_binary() == Path(sys.executable).parent / "mooncake_master"
    # not next to the interpreter: PATH is searched
    on_path = tmp_path / "bin" / "mooncake_master"
    on_path.parent.mkdir()
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    monkeypatch.setattr(mm.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert master_binary() == on_path
    # nowhere: the error says what to install
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match=r"vllm-kvbridge\[mooncake\]"):
        master_binary()
    with pytest.raises(FileNotFoundError):
        MooncakeMaster(log_dir=tmp_path).start()


def test_master_dies_with_the_process_that_started_it(tmp_path: Path):
    code = textwrap.dedent(
        """
        import sys, time
        from vllm_kvbridge.connectors.mooncake_master import MooncakeMaster
        master = MooncakeMaster(log_dir=sys.argv[1]).start()
        print(master.pid, flush=True)
        time.sleep(120)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        assert not _gone(pid, within=0.2)
        owner.send_signal(signal.SIGKILL)  # no cleanup runs in the owner
        owner.wait(10)
        assert _gone(pid), "the master outlived the process that started it"
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
