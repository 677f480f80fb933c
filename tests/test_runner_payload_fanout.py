"""TP > 1 fan-out of received payloads (``broadcast_payload``) over real gloo process groups.

TP rank 0 of the receiving stage receives (full payload and async-chunk stream, real
shared-memory edges from a producer process); every rank of the TP group gets the same
payload bit-exact through ``kvbridge_get_payload``, and a failure on rank 0 (nothing
arrived in time, the sender aborted) reaches every rank as an error with its reason.
"""

from __future__ import annotations

import gc
import os
import socket

import pytest
import torch.multiprocessing as mp
from runner_fixtures import fanout_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.forked
@pytest.mark.parametrize("tp", [2, 4])
def test_received_payload_reaches_every_tp_rank_bit_exact(tp: int) -> None:
    ns = f"rtfan{tp}x{os.getpid()}"
    world = tp + 1
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(
            fanout_worker,
            args=(world, _free_port(), ns, results),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        out = dict(results)
    # The spawn context's queues hold named semaphores, unlinked by their finalizers: run
    # them now (a forked test process ends with os._exit, which would skip them).
    gc.collect()
    assert out[tp] == {"sent": True}
    for rank in range(tp):
        got = out[rank]
        assert got["full_exact"] and got["chunk_exact"], (rank, got)
        assert got["threads"] == 0, (rank, got)
        if rank == 0:  # the leader raises its own error ...
            assert got["r-missing"].startswith("timeout:") and "did not arrive" in got["r-missing"]
            assert got["r-abort"].startswith("aborted:") and "producer gave up" in got["r-abort"]
        else:  # ... and every follower gets it, with the leader's reason
            assert got["r-missing"].startswith("error: payload fan-out from rank 0 failed")
            assert "did not arrive" in got["r-missing"], got
            assert (
                got["r-abort"].startswith("error: payload fan-out") and "producer gave up" in got["r-abort"]
            )
    assert [n for n in os.listdir("/dev/shm") if ns in n] == []
