"""The connector layer's one reaping entry point, ``reap_dead_leftovers``, with real processes.

A spawned child puts on shared-memory edges and dies by SIGKILL (nothing of its clean-up
runs); the entry point must remove exactly its names, keep a live process's, reap an edge
listed twice once, and skip connectors without named OS resources.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import uuid
from typing import Any

import pytest
import torch

from vllm_kvbridge.connectors.leftovers import reap_dead_leftovers, shared_memory_names
from vllm_kvbridge.connectors.registry import register_connector
from vllm_kvbridge.connectors.shm import SharedMemoryConnector

pytestmark = pytest.mark.forked


class _RenamedShm(SharedMemoryConnector):
    """A third-party subclass: it reaps through the hook it inherits."""

    name = "LeftoversTestShm"


register_connector("LeftoversTestShm", _RenamedShm, replace=True)
register_connector("LeftoversTestFactory", lambda config: SharedMemoryConnector(config), replace=True)


def _entries(token: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if token in n)


def _killed_child(edges: list[tuple[str, str, dict[str, Any]]], report: Any) -> None:
    conns = [SharedMemoryConnector(cfg) for _, _, cfg in edges]
    for conn, (a, b, _) in zip(conns, edges):
        assert conn.put(a, b, "orphan", {"h": torch.ones(3)}).ok
    report.put(os.getpid())
    report.close()
    report.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def _run_killed_child(edges: list[tuple[str, str, dict[str, Any]]]) -> int:
    """The pid of a child that put on ``edges`` and died by SIGKILL.

    Waits for the child's report as long as the child lives (a loaded host can take long to
    start a spawned interpreter), and fails at once, with its exit code, if it died first.
    """
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    child = ctx.Process(target=_killed_child, args=(edges, report))
    child.start()
    while True:
        try:
            pid = report.get(timeout=1)
            break
        except queue.Empty:
            if not child.is_alive():  # the report was flushed before the kill: one last look
                try:
                    pid = report.get(timeout=1)
                    break
                except queue.Empty:
                    pytest.fail(f"the child exited with {child.exitcode} before reporting")
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    return pid


def test_dead_processes_names_are_reaped_once_and_live_ones_kept() -> None:
    token = "lo" + uuid.uuid4().hex[:10]
    named = {"namespace": f"{token}n"}  # explicit namespace
    a, b = f"{token}a", f"{token}b"  # no namespace: the edge's name, unique to this test
    live = SharedMemoryConnector(named)
    try:
        assert live.put(0, 1, "alive", {"x": torch.zeros(2)}).ok
        mine = _entries(token)
        pid = _run_killed_child([("0", "1", named), (a, b, {})])
        dead = [n for n in _entries(token) if n not in mine]
        assert any(f".p.{pid}." in n for n in dead) and sum(".k." in n for n in dead) == 2, dead
        edges = [
            (0, 1, "SharedMemoryConnector", named),
            (0, 1, "SharedMemoryConnector", dict(named)),  # the same edge, seen from the receiver
            (a, b, "shm", {}),  # registry aliases resolve to the same connector
            (0, 1, "ZmqConnector", {"host": "127.0.0.1", "port": 0}),  # no named OS resources
            (0, 1, "NoSuchConnector", {}),  # cannot have leftovers of ours
        ]
        removed = reap_dead_leftovers(edges)
        assert sorted(removed) == sorted(dead)  # each name once, only the dead process's
        assert _entries(token) == mine
        assert shared_memory_names(f"{token}n") == mine
        assert reap_dead_leftovers(edges) == []
    finally:
        live.close()
    assert _entries(token) == []


def test_connector_subclasses_reap_through_the_hook_and_plain_factories_are_skipped() -> None:
    token = "ls" + uuid.uuid4().hex[:10]
    cfg = {"namespace": token}
    _run_killed_child([("0", "1", cfg)])
    dead = _entries(token)
    assert dead
    assert reap_dead_leftovers([(0, 1, "LeftoversTestFactory", cfg)]) == []  # no class to ask
    assert _entries(token) == dead
    assert sorted(reap_dead_leftovers([(0, 1, "LeftoversTestShm", cfg)])) == dead
    assert _entries(token) == []


def _killed_run_child(run: str, edges: list[tuple[str, str, dict[str, Any]]], report: Any) -> None:
    """``_killed_child`` as a process of run ``run``: it holds the run's owner lock."""
    from vllm_kvbridge.connectors.leftovers import hold_owner

    owner = hold_owner(run, "test")
    _killed_child(edges, report)
    owner.release()  # not reached: the child kills itself


def _run_killed_run_child(run: str, edges: list[tuple[str, str, dict[str, Any]]]) -> None:
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    child = ctx.Process(target=_killed_run_child, args=(run, edges, report))
    child.start()
    while True:  # as long as the child lives (see _run_killed_child)
        try:
            report.get(timeout=1)
            break
        except queue.Empty:
            if not child.is_alive():
                report.get(timeout=1)  # raises if it died before reporting
                break
    child.join(120)
    assert child.exitcode == -signal.SIGKILL


def test_a_restarted_run_reaps_an_earlier_killed_runs_names_on_edges_it_does_not_have() -> None:
    """Issue 36 item 4: each run's edges have their own namespace (``<run id>-<edge>``), so the
    edge-scoped reap of a restarted run never sees a SIGKILLed earlier run's segments; the
    host-wide reap of dead runs does, by their owner locks, and keeps a live run's."""
    from vllm_kvbridge.connectors.leftovers import reap_dead_runs

    token = "lr" + uuid.uuid4().hex[:10]
    earlier, restarted = {"namespace": f"{token}a-0-1"}, {"namespace": f"{token}b-0-1"}
    _run_killed_run_child(f"{token}a", [("0", "1", earlier)])
    dead = _entries(f"{token}a")
    assert len(dead) == 3  # pool segment, published key, the run's owner file
    live = SharedMemoryConnector(restarted)
    try:
        assert live.put(0, 1, "alive", {"x": torch.zeros(2)}).ok
        mine = _entries(f"{token}b")
        assert reap_dead_leftovers([(0, 1, "shm", restarted)]) == []
        assert _entries(token) == sorted(dead + mine)  # what the restarted run reaped: nothing
        assert sorted(reap_dead_runs(prefix=token)) == dead
        assert _entries(token) == mine
    finally:
        live.close()
    assert _entries(token) == []
