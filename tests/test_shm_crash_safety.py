"""Crash-safe shared memory (issue 36 item 4): what a SIGKILLed run left in /dev/shm is reaped
by any later process, in any PID namespace, and nothing a live process may own is touched.

A run's process holds an owner lock (``shm_owners.hold_owner``) and records the ``psm_*`` /
``sem.mp-*`` names it maps; here a real child process makes our pool and published segments
(the shm connector), a real ``multiprocessing.shared_memory`` queue segment and a real named
semaphore, and dies by SIGKILL. Liveness is the lock, so a pid that coincides with a live one
(a run in another PID namespace) or that cannot be seen (a reaper in another one) changes
nothing. Every reap is limited to this test's run ids (``prefix``): other tests on the host
leave dead segments on purpose and check them.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from vllm_kvbridge.connectors.shm_owners import OWNER_PREFIX, hold_owner, owners, reap_dead_runs

pytestmark = pytest.mark.forked

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]
SHM = Path("/dev/shm")

# The resource tracker is switched off in the children: a SIGKILLed process group takes its
# tracker down with it (serve's stages), while a lone tracker would see its parent's pipe
# close and unlink the names itself, racing the reaper under test.
NO_TRACKER = """
    from multiprocessing import resource_tracker
    resource_tracker.register = resource_tracker.unregister = lambda *a, **k: None
"""

#: A process of run argv[1]: holds the owner lock, prints "held", reads the names of a foreign
#: process to map, makes its own names, records what it maps, prints them, waits for a line,
#: then stops cleanly (prints what its owner's release removed).
RUN = (
    NO_TRACKER
    + """
    import json, mmap, os, sys
    import multiprocessing as mp
    from multiprocessing import shared_memory
    import torch
    from vllm_kvbridge.connectors import create_connector, payload_key
    from vllm_kvbridge.connectors.shm_owners import hold_owner

    run = sys.argv[1]
    owner = hold_owner(run, "test-run")
    print("held", flush=True)
    foreign = sys.stdin.readline().split()
    conn = create_connector("shm", {"namespace": f"{run}-0-1"})
    assert conn.put(0, 1, payload_key("req", 0, 1), {"x": torch.ones(1024)}).ok
    queue = shared_memory.SharedMemory(create=True, size=1 << 16)  # like vLLM's message queue
    lock = mp.get_context("spawn").Lock()  # a named semaphore: sem.mp-*
    views = []
    for name in foreign:
        fd = os.open("/dev/shm/" + name, os.O_RDONLY)
        views.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
        os.close(fd)
    recorded = owner.record_mapped()
    print(json.dumps({
        "pid": os.getpid(),
        "owner": os.path.basename(owner.path),
        "own": [queue.name, "sem." + lock._semlock.name.lstrip("/")],
        "recorded": recorded,
    }), flush=True)
    sys.stdin.readline()
    conn.close()
    queue.close()
    queue.unlink()
    del lock  # its finalizer unlinks the semaphore's name
    print(json.dumps(owner.release()), flush=True)
"""
)

#: A process of no run: makes a shared-memory segment and a named semaphore per "make" line
#: (printing their names), keeps them mapped, and removes them at the first other line.
FOREIGN = (
    NO_TRACKER
    + """
    import json, sys
    import multiprocessing as mp
    from multiprocessing import shared_memory
    made = []
    for line in sys.stdin:
        if line.strip() != "make":
            break
        shm, lock = shared_memory.SharedMemory(create=True, size=4096), mp.get_context("spawn").Lock()
        made.append((shm, lock))
        print(json.dumps([shm.name, "sem." + lock._semlock.name.lstrip("/")]), flush=True)
    for shm, _ in made:
        shm.close()
        shm.unlink()
    made.clear()
    print("done", flush=True)
"""
)

#: Another process of run argv[1] (the orchestrator's role): holds an owner lock until killed.
HOLD = """
    import sys
    from vllm_kvbridge.connectors.shm_owners import hold_owner
    owner = hold_owner(sys.argv[1], "orchestrator")
    print("held", flush=True)
    sys.stdin.readline()
"""

REAP = """
    import json, os, sys
    from vllm_kvbridge.connectors.shm_owners import reap_dead_runs
    print(json.dumps([os.getpid(), reap_dead_runs(prefix=sys.argv[1])]))
"""


def _require_unshare() -> None:
    if subprocess.run([*UNSHARE, "true"], capture_output=True).returncode != 0:
        pytest.fail("unshare --pid needs root (CI and the dev machines run as root)")


def _python(code: str, *args: str, pid_namespace: bool = False) -> subprocess.Popen:
    prefix = UNSHARE if pid_namespace else []
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _send(proc: subprocess.Popen, line: str = "") -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _read(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the child exited with {proc.wait(60)} before answering"
    return line.strip()


def _entries(token: str) -> set[str]:
    return {n for n in os.listdir(SHM) if token in n}


def _kill(proc: subprocess.Popen, host_pid: int | None = None) -> None:
    os.kill(host_pid or proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL or host_pid is not None


def _child_of(pid: int) -> int:
    """The pid here of ``pid``'s only child (the process unshare started in the namespace)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                return int(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    pytest.fail(f"process {pid} has no child")


@contextmanager
def _processes(token: str) -> Iterator[list[subprocess.Popen]]:
    """Children started in the block; a failed test ends them cleanly (their stdin closes:
    each removes its names) or, failing that, kills them and reaps what they left."""
    started: list[subprocess.Popen] = []
    try:
        yield started
    finally:
        for proc in started:
            if proc.poll() is None:
                assert proc.stdin is not None
                proc.stdin.close()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(60)
        reap_dead_runs(prefix=token)


def _start_run(started: list[subprocess.Popen], run: str, *, pid_namespace: bool = False) -> subprocess.Popen:
    proc = _python(RUN, run, pid_namespace=pid_namespace)
    started.append(proc)
    assert _read(proc) == "held"
    return proc


def _made(proc: subprocess.Popen, foreign: Sequence[str] = ()) -> dict:
    _send(proc, " ".join(foreign))
    return json.loads(_read(proc))


def _reap_elsewhere(prefix: str, *, pid_namespace: bool = False) -> tuple[int, list[str]]:
    reaper = _python(REAP, prefix, pid_namespace=pid_namespace)
    out, _ = reaper.communicate(timeout=120)
    assert reaper.returncode == 0
    pid, removed = json.loads(out)
    return pid, removed


def _stop_cleanly(proc: subprocess.Popen) -> list[str]:
    _send(proc)
    released = json.loads(_read(proc))
    assert proc.wait(60) == 0
    return released


def test_a_killed_runs_names_are_reaped_and_live_and_foreign_names_are_kept() -> None:
    token = "cs" + uuid.uuid4().hex[:10]
    with _processes(token) as started:
        foreign = _python(FOREIGN)
        started.append(foreign)
        _send(foreign, "make")
        existed = json.loads(_read(foreign))  # before the run's owner lock: never recorded
        dead = _start_run(started, f"{token}d")
        live = _start_run(started, f"{token}l")
        _send(foreign, "make")
        later = json.loads(_read(foreign))  # after it: only "still mapped" protects these
        info = _made(dead, existed + later)
        live_info = _made(live)
        assert sorted(info["recorded"]) == sorted(info["own"] + later)
        dead_names = _entries(f"{token}d-") | set(info["own"])
        assert len(dead_names) == 4  # pool segment, published key, queue, semaphore
        live_names = _entries(f"{token}l") | set(live_info["own"])
        before = _entries(token) | set(existed + later) | set(live_info["own"])
        _kill(dead)

        _, removed = _reap_elsewhere(token)

        assert sorted(removed) == sorted(dead_names)
        left = before - dead_names
        assert {n for n in left if (SHM / n).exists()} == left  # live run, foreign, owner files
        # The dead owner keeps the names still mapped by the live foreign process: once they
        # are unmapped the next reap deals with them (here: the foreign process removes them).
        (record,) = [o for o in owners(prefix=f"{token}d")]
        assert not record.alive and sorted(record.names) == sorted(later)
        assert record.file == info["owner"]
        _send(foreign, "stop")
        assert _read(foreign) == "done"
        assert reap_dead_runs(prefix=token) == [info["owner"]]
        assert reap_dead_runs(prefix=token) == []

        assert all((SHM / n).exists() for n in live_names)
        assert _stop_cleanly(live) == []  # it removed its names itself
    assert _entries(token) == set()


def test_a_dead_run_whose_pid_is_alive_here_is_reaped() -> None:
    """The run lives in another PID namespace, where its pid is 1: here pid 1 is init, alive.
    A pid lookup would keep its names for good; the free lock says it is dead."""
    _require_unshare()
    token = "cp" + uuid.uuid4().hex[:10]
    with _processes(token) as started:
        unshare = _start_run(started, f"{token}d", pid_namespace=True)
        info = _made(unshare)
        assert info["pid"] == 1 and Path("/proc/1").exists()
        (record,) = owners(prefix=token)
        assert record.pid == 1 and record.alive
        dead_names = _entries(token) | set(info["own"])
        live = _start_run(started, f"{token}l")
        _made(live)
        live_names = _entries(f"{token}l")
        _kill(unshare, _child_of(unshare.pid))

        removed = reap_dead_runs(prefix=token)

        assert sorted(removed) == sorted(dead_names) and len(removed) == 5  # 4 names, 1 owner file
        assert _entries(token) == live_names
        _stop_cleanly(live)
    assert _entries(token) == set()


def test_a_reaper_in_another_pid_namespace_reaps_the_dead_run_and_keeps_the_live_one() -> None:
    """The reaper cannot see the live run's process (nor the dead one's): only locks tell."""
    _require_unshare()
    token = "cn" + uuid.uuid4().hex[:10]
    with _processes(token) as started:
        dead = _start_run(started, f"{token}d")
        live = _start_run(started, f"{token}l")
        info = _made(dead)
        _made(live)
        dead_names = _entries(f"{token}d") | set(info["own"])
        live_names = _entries(f"{token}l")
        _kill(dead)

        pid_there, removed = _reap_elsewhere(token, pid_namespace=True)

        assert pid_there == 1  # it ran where neither run's pid exists
        assert sorted(removed) == sorted(dead_names) and len(removed) == 5
        assert _entries(token) == live_names
        _stop_cleanly(live)
    assert _entries(token) == set()


def _psm_style() -> tuple[str, mmap.mmap]:
    """A new ``psm_``-style file (what ``SharedMemory`` makes), mapped by this process."""
    name = f"psm_{secrets.token_hex(8)}"
    fd = os.open(SHM / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    view = mmap.mmap(fd, 4096)
    os.close(fd)
    return name, view


def test_a_clean_release_removes_what_the_owner_recorded_and_nothing_maps() -> None:
    token = "cr" + uuid.uuid4().hex[:10]
    existed, existed_view = _psm_style()
    try:
        with hold_owner(token, "test") as owner:
            assert (SHM / os.path.basename(owner.path)).name.startswith(f"{OWNER_PREFIX}{token}.")
            mine, view = _psm_style()
            still, still_view = _psm_style()
            assert sorted(owner.record_mapped()) == sorted([mine, still])  # not the one before
            assert owner.record_mapped() == []  # recorded once
            assert reap_dead_runs(prefix=token) == []  # its owner lives
            view.close()  # e.g. the queue of an engine core that was killed
            removed = owner.release()
            assert removed == [mine]  # `still` is mapped by a live process (this one)
            assert (SHM / still).exists() and (SHM / existed).exists()
            assert owner.release() == []
        assert owners(prefix=token) == []
    finally:
        existed_view.close()
        still_view.close()
        for name in (existed, still):
            (SHM / name).unlink(missing_ok=True)


def test_only_recordable_names_that_exist_are_recorded() -> None:
    token = "cw" + uuid.uuid4().hex[:10]
    with hold_owner(token) as owner:
        name, view = _psm_style()
        try:
            other = SHM / f"kvbridge.{token}.p.1.ab"  # our segments carry their own locks
            other.write_bytes(b"x")
            assert owner.record([name, other.name, "psm_0123456789abcdef", "../etc/passwd"]) == [name]
            assert owner.recorded == frozenset({name})
        finally:
            view.close()
            other.unlink(missing_ok=True)
        assert owner.release() == [name]
    assert not (SHM / name).exists()


#: A process that only holds run argv[1]'s owner lock (a stage process whose engine does the
#: sending), and one that only puts on the run's edge without holding one (its vLLM worker).
OWNER_ONLY = """
    import sys
    from vllm_kvbridge.connectors.shm_owners import hold_owner
    owner = hold_owner(sys.argv[1], "stage")
    print("held", flush=True)
    sys.stdin.readline()
    owner.release()
"""
WORKER = """
    import sys, torch
    from vllm_kvbridge.connectors import create_connector, payload_key
    conn = create_connector("shm", {"namespace": f"{sys.argv[1]}-0-1"})
    assert conn.put(0, 1, payload_key("req", 0, 1), {"x": torch.ones(1024)}).ok
    print("held", flush=True)
    sys.stdin.readline()
    conn.close()
"""


def test_a_dead_owners_file_stays_while_its_runs_segments_are_held_and_goes_with_them() -> None:
    """A killed stage process's vLLM worker may outlive it for a while, holding the run's
    segments: they are kept (their own lock), and so is the dead owner's file, which is what
    lets the next reap find the run again once the worker is gone."""
    token = "ck" + uuid.uuid4().hex[:10]
    run = f"{token}d"
    with _processes(token) as started:
        stage, worker = _python(OWNER_ONLY, run), _python(WORKER, run)
        started += [stage, worker]
        assert _read(stage) == "held" and _read(worker) == "held"
        names = _entries(token)
        segments = _entries(f"{run}-")
        assert len(names) == 3 and len(segments) == 2  # owner file; pool segment, published key
        _kill(stage)

        assert reap_dead_runs(prefix=token) == []
        assert _entries(token) == names
        (record,) = owners(prefix=token)
        assert not record.alive

        _kill(worker)
        assert reap_dead_runs(prefix=token) == sorted(names)
    assert _entries(token) == set()


def test_a_live_runs_dead_stage_keeps_its_published_segments_until_the_run_ends() -> None:
    """A stage killed while its run lives (the orchestrator restarts it): its vLLM queues and
    semaphores go at once, but a segment it published stays - shared memory outlives its
    sender and the consumer may still read it (the run's orchestrator reaps its own edges).
    Once no process of the run lives, the reap takes the segments too."""
    token = "cs" + uuid.uuid4().hex[:10]
    run = f"{token}r"
    with _processes(token) as started:
        stage = _start_run(started, run)
        orchestrator = _python(HOLD, run)  # another process of the same run, alive
        started.append(orchestrator)
        assert _read(orchestrator) == "held"
        info = _made(stage)
        stage_segments = {n for n in _entries(f"{run}-") if f".p.{info['pid']}." in n}
        assert stage_segments  # its pool segment and the published key
        _kill(stage)

        _, removed = _reap_elsewhere(token)

        assert sorted(removed) == sorted(info["own"])  # the queue and the semaphore only
        assert all((SHM / n).exists() for n in stage_segments)
        _kill(orchestrator)
        _, removed = _reap_elsewhere(token)
        assert stage_segments <= set(removed)
    assert _entries(token) == set()
