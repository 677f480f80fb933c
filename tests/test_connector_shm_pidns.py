"""Shared-memory liveness across PID namespaces (issue 11, case 12).

Containers of one Kubernetes pod share ``/dev/shm`` but not their PID namespace, so a pid
written by one process means nothing (or another process) to its peer. These tests put
one side into a fresh PID namespace with ``unshare --pid --fork --mount-proc`` (root is
available here and in CI) and check that a live peer is never taken for dead: a reaper
in the other namespace leaves a live sender's segments alone, and a sender in the other
namespace never reuses a segment that a live receiver still reads. Liveness is a lock
held on the segment's file description, which every namespace sees.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from runner_fixtures import shm_entries, shm_namespace

from vllm_kvbridge.connectors import create_connector, payload_key

pytestmark = pytest.mark.forked

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def _in_new_pid_namespace(code: str, *args: str, **popen: object) -> subprocess.Popen:
    if subprocess.run([*UNSHARE, "true"], capture_output=True).returncode != 0:
        pytest.fail("unshare --pid needs root (CI and the dev machines run as root)")
    return subprocess.Popen(
        [*UNSHARE, sys.executable, "-c", textwrap.dedent(code), *args], text=True, **popen
    )


def _payload(seed: int) -> dict[str, torch.Tensor]:
    return {"x": torch.full((1 << 18,), float(seed))}


REAP = """
    import json, sys
    from vllm_kvbridge.connectors import shm_segments
    print(json.dumps([os.getpid(), shm_segments.reap_stale(sys.argv[1])]))
""".replace("import json, sys", "import json, os, sys")


def test_a_reaper_in_another_pid_namespace_leaves_a_live_senders_segments() -> None:
    ns = shm_namespace("pidr")
    with create_connector("shm", {"namespace": ns}) as sender:
        result = sender.put(0, 1, payload_key("r", 0, 1), _payload(1))
        assert result.ok and len(shm_entries(ns)) == 2  # pool name + published key
        reaper = _in_new_pid_namespace(REAP, ns, stdout=subprocess.PIPE)
        out, _ = reaper.communicate(timeout=60)
        pid_there, removed = json.loads(out)
        assert pid_there == 1  # it really ran in a namespace where our pid does not exist
        assert removed == [], "a live sender's segments were reaped from another PID namespace"
        with create_connector("shm", {"namespace": ns}) as receiver:
            got = receiver.get(0, 1, payload_key("r", 0, 1), result.metadata, deadline=None)
            assert torch.equal(got["x"], _payload(1)["x"])
            del got
    assert shm_entries(ns) == []


def test_a_reaper_in_another_pid_namespace_removes_a_dead_senders_segments() -> None:
    ns = shm_namespace("pidd")
    put = """
        import sys, torch
        from vllm_kvbridge.connectors import create_connector, payload_key
        conn = create_connector("shm", {"namespace": sys.argv[1]})
        assert conn.put(0, 1, payload_key("r", 0, 1), {"x": torch.ones(1 << 18)}).ok
        print("ready", flush=True)
        sys.stdin.readline()
    """
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(put), ns],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    assert len(shm_entries(ns)) == 2
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)
    reaper = _in_new_pid_namespace(REAP, ns, stdout=subprocess.PIPE)
    _, removed = json.loads(reaper.communicate(timeout=60)[0])
    assert len(removed) == 2 and shm_entries(ns) == []


SENDER = """
    import sys, time, torch
    from vllm_kvbridge.connectors import create_connector, payload_key
    conn = create_connector("shm", {"namespace": sys.argv[1], "reap_interval_s": 0.02})
    r = conn.put(0, 1, payload_key("a", 0, 1), {"x": torch.full((1 << 18,), 1.0)})
    print("ready" if r.ok else "failed", flush=True)
    sys.stdin.readline()
    time.sleep(0.5)  # several sweeps: a claimer taken for dead would be robbed now
    r = conn.put(0, 1, payload_key("b", 0, 1), {"x": torch.full((1 << 18,), 2.0)})
    print("done" if r.ok else "failed", flush=True)
    sys.stdin.readline()
    conn.close()
"""


def test_a_sender_in_another_pid_namespace_never_reuses_a_segment_being_read() -> None:
    ns = shm_namespace("pids")
    sender = _in_new_pid_namespace(SENDER, ns, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert sender.stdout.readline().strip() == "ready"
        with create_connector("shm", {"namespace": ns}) as receiver:
            held = receiver.get(0, 1, payload_key("a", 0, 1), None, deadline=None)
            assert torch.equal(held["x"], _payload(1)["x"])
            sender.stdin.write("next\n")
            sender.stdin.flush()
            assert sender.stdout.readline().strip() == "done"
            # The payload we still hold was not overwritten by the sender's next put.
            assert torch.equal(held["x"], _payload(1)["x"])
            got = receiver.get(0, 1, payload_key("b", 0, 1), None, deadline=None)
            assert torch.equal(got["x"], _payload(2)["x"])
            del held, got
        sender.stdin.write("exit\n")
        sender.stdin.flush()
        assert sender.wait(30) == 0
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait(30)
    assert shm_entries(ns) == []
