"""The engine-progress view a stage's heartbeat carries (issue 36, item 2), on real processes:
the progress board written by other processes, and a stage's stopped descendants.

The end-to-end cases (a stopped engine core, a wedged worker, under a real server) are in
test_serve_supervision.py; these pin the pieces they rest on, fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from vllm_kvbridge.pipeline.liveness import EngineLiveness
from vllm_kvbridge.runner import progress

#: A process that takes a slot on the board in its environment, touches it ``N`` times
#: (one per line it reads), then waits to be killed.
WRITER = """
import sys, time
from vllm_kvbridge.runner import progress
progress.open_from_env()
print("claimed", flush=True)
for line in sys.stdin:
    time.sleep(progress.TOUCH_EVERY_S)
    progress.touch()
    print("touched", flush=True)
"""


@pytest.fixture
def board():  # type: ignore[no-untyped-def]
    path, mapped = progress.create()
    try:
        yield path, mapped
    finally:
        os.unlink(path)


def _writer(path: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER],
        env={**os.environ, progress.PROGRESS_ENV: path},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "claimed\n"
    return proc


def _touch(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "touched\n"


def test_each_process_gets_its_own_slot_and_its_steps_show(board) -> None:  # type: ignore[no-untyped-def]
    path, mapped = board
    a, b = _writer(path), _writer(path)
    try:
        ages = progress.read_ages(mapped)
        assert set(ages) == {a.pid, b.pid}
        later = time.monotonic() + 5.0
        ages = progress.read_ages(mapped, later)
        assert all(age >= 5.0 for age in ages.values())
        _touch(a)  # a made a step, b did not
        ages = progress.read_ages(mapped, later)
        assert ages[a.pid] < 5.0 <= ages[b.pid]
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_a_forked_child_claims_a_slot_of_its_own(board) -> None:  # type: ignore[no-untyped-def]
    path, mapped = board
    code = (
        "import os; from vllm_kvbridge.runner import progress; progress.open_from_env();"
        "pid = os.fork()\n"
        "if pid == 0:\n progress.open_from_env(); progress.touch(); os._exit(0)\n"
        "os.waitpid(pid, 0); print(pid)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, progress.PROGRESS_ENV: path},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) in progress.read_ages(mapped) and len(progress.read_ages(mapped)) == 2


def test_no_board_in_the_environment_is_no_error() -> None:
    code = "from vllm_kvbridge.runner import progress; progress.open_from_env(); progress.touch()"
    env = {k: v for k, v in os.environ.items() if k != progress.PROGRESS_ENV}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_a_wait_is_a_stall_only_while_the_engine_makes_no_step(board) -> None:  # type: ignore[no-untyped-def]
    path, mapped = board
    engine = _writer(path)
    try:
        live = EngineLiveness(mapped, root_pid=engine.pid)
        assert live.stall() == (0.0, "")  # the serve loop has not started: a starting engine
        live.turn()
        t = time.monotonic()
        # The loop waits on the engine, which keeps stepping (a talker waiting for its rows).
        _touch(engine)
        stalled, _ = live.stall(time.monotonic())
        assert stalled < 1.0
        # It stops stepping: the stall is as long as both the wait and its silence.
        stalled, why = live.stall(t + 30.0)
        assert stalled >= 29.0 and f"engine process {engine.pid} made no step" in why
        live.turn()  # the loop goes on: nothing stalls, however old the engine's last step
        assert live.stall()[0] < 1.0
    finally:
        engine.kill()
        engine.wait()


def test_without_a_board_the_wait_alone_counts() -> None:
    live = EngineLiveness(None, root_pid=os.getpid())
    live.turn()
    stalled, why = live.stall(time.monotonic() + 12.0)
    assert stalled >= 12.0 and "its serve loop has waited" in why


def test_a_stopped_descendant_is_a_stall_from_when_it_was_first_seen_stopped() -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"])
    try:
        live = EngineLiveness(None, root_pid=parent.pid)
        live.turn()
        deadline = time.monotonic() + 30
        while not (kids := [p for p in _children(parent.pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kids, "the child never started"
        grandchild = kids[0]
        os.kill(grandchild, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while "stopped" not in live.stall()[1] and time.monotonic() < deadline:
            live.turn()
            time.sleep(0.05)
        t = time.monotonic()
        stalled, why = live.stall(t + 20.0)
        assert stalled >= 20.0 and f"engine process {grandchild} stopped (state T)" in why
        os.kill(grandchild, signal.SIGCONT)
        live.turn()
        deadline = time.monotonic() + 10
        while live.stall()[0] > 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.stall()[0] < 1.0  # resumed: no stall
    finally:
        parent.kill()
        parent.wait()


def test_a_stopped_descendant_is_named_even_when_the_wait_on_it_began_first() -> None:
    """The serve loop starts a turn that waits on the engine (a stats RPC), then the engine is
    seen stopped: the wait is longer than the stop as seen, yet the stop is its cause, and
    the reason names it whichever of the two the heartbeat thread noticed first."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.run(['sleep', '60'])"])
    try:
        live = EngineLiveness(None, root_pid=parent.pid)
        deadline = time.monotonic() + 30
        while not (kids := _children(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kids, "the child never started"
        live.turn()  # the loop's turn (waiting on the engine) began before the stop was seen
        time.sleep(1.0)
        os.kill(kids[0], signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not procfs_stopped(kids[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        stalled, why = live.stall()  # first look: the stop is seen now, the wait is older
        assert stalled >= 1.0 and f"engine process {kids[0]} stopped (state T)" in why, why
        os.kill(kids[0], signal.SIGCONT)
    finally:
        parent.kill()
        parent.wait()


def procfs_stopped(pid: int) -> bool:
    from vllm_kvbridge import procfs

    return procfs.state(pid) in procfs.STOPPED_STATES


def _children(pid: int) -> list[int]:
    from vllm_kvbridge import procfs

    return procfs.descendants(pid)
