"""Probe tests for tests/test_suite_guard.py: run by it in a pytest subprocess (this file is
not ``test_*``, so the suite itself never collects it). Each leaves or starts one thing the
suite guard must report, or must not."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time

import pytest

#: A child that looks like a vLLM engine core to the guard for 2 s: its process title (the
#: one test_suite_guard.py tells this run's guard to look for).
ENGINE_LIKE = (
    "import os, setproctitle, time;"
    "setproctitle.setproctitle(os.environ['KVBRIDGE_GUARD_ENGINE_TITLE'] + '_DP0'); time.sleep(2)"
)
#: A process outside the test's tree (its parent exits first) that creates a /dev/shm name,
#: holds it 2 s and leaves it.
FOREIGN = """
import os, sys, time
parent = os.getpid()
if os.fork():
    os._exit(0)
while True:  # wait until the parent is gone: no longer a descendant of the test
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        break
    time.sleep(0.01)
fd = os.open('/dev/shm/' + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)
time.sleep(2)
"""


def test_leaves_a_shm_name() -> None:
    fd = os.open(f"/dev/shm/{os.environ['PROBE_SHM_NAME']}", os.O_CREAT | os.O_RDWR, 0o600)
    time.sleep(1.5)  # open while the guard looks (it scans every 0.5 s)
    os.close(fd)


#: A child seen by the guard (it lives 1.2 s) that then makes a segment-named file in one go
#: and exits: never seen holding it, it is the run's by the creator pid in its name.
BRIEF_CREATOR = """
import os, sys, time
time.sleep(1.2)
name = f"/dev/shm/kvbridge.{sys.argv[1]}.p.{os.getpid()}.probe0"
os.close(os.open(name, os.O_CREAT | os.O_RDWR, 0o600))
"""


def test_a_brief_child_leaves_a_segment() -> None:
    subprocess.run([sys.executable, "-c", BRIEF_CREATOR, os.environ["PROBE_NAMESPACE"]], check=True)


def test_leaves_a_temp_dir() -> None:
    tempfile.mkdtemp(prefix="kvb-probe-")


def test_starts_an_engine_unmarked() -> None:
    subprocess.run([sys.executable, "-c", ENGINE_LIKE], check=True)


@pytest.mark.engine
def test_starts_an_engine_marked() -> None:
    subprocess.run([sys.executable, "-c", ENGINE_LIKE], check=True)


def test_another_process_makes_a_name() -> None:
    subprocess.run([sys.executable, "-c", FOREIGN, os.environ["PROBE_FOREIGN_NAME"]], check=True)
    time.sleep(3)


def test_cleans_up() -> None:
    path = tempfile.mkdtemp(prefix="kvb-tidy-")
    os.rmdir(path)
    name = f"/dev/shm/psm_{secrets.token_hex(4)}"
    fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
    time.sleep(1)
    os.close(fd)
    os.unlink(name)
