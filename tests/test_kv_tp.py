"""Heterogeneous TP and LEADER/FOLLOWER distribution with real gloo process groups."""

from __future__ import annotations

import os
import socket

import pytest
import torch.multiprocessing as mp
from kv_fixtures import tp_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(s: int, t: int, mode: str, ns: str) -> dict[int, dict]:
    world = s + t
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            tp_worker,
            args=(world, _free_port(), s, t, mode, ns, results),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        out = dict(results)
    assert not [n for n in os.listdir("/dev/shm") if ns in n]
    return out


@pytest.mark.forked
@pytest.mark.slow  # 2 to 8 spawned gloo ranks per case, ~45 s for the module
@pytest.mark.parametrize(("s", "t"), [(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 2)])
def test_tp_matrix_every_receiver_gets_exactly_its_heads(s: int, t: int) -> None:
    out = _run(s, t, "tp", f"kvtesttp{s}{t}")
    for rank in range(s):
        assert out[rank] == {"sent": ["tp-a", "tp-b"]}
    for rank in range(s, s + t):
        assert out[rank] == {"role": "local", "exact": True}


@pytest.mark.forked
@pytest.mark.slow  # 2 or 4 spawned gloo ranks per case
@pytest.mark.parametrize("group", [2, 4])
def test_leader_follower_distribution(group: int) -> None:
    out = _run(1, group, "leader", f"kvtestlead{group}")
    assert out[1]["role"] == "leader" and out[1]["exact"] and out[1]["failure"] == "timeout"
    for rank in range(2, 1 + group):
        assert out[rank]["role"] == "follower" and out[rank]["exact"]
        assert out[rank]["failure"].startswith("error: the leader rank failed")
