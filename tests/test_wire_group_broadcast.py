"""``broadcast_buffers`` (wire/group_broadcast.py), the one way the KV leader, the payload
TP fan-out and the 2-rank diffusion control hand bytes across a group: over a real gloo
group of three spawned processes, rank 1 the source."""

from __future__ import annotations

import gc
import socket

import pytest
import torch
import torch.multiprocessing as mp

from vllm_kvbridge.errors import TransferError
from vllm_kvbridge.wire.group_broadcast import MAX_BUFFERS, broadcast_buffers

SRC = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _u8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _worker(rank: int, world: int, port: int, out) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    got: dict[str, object] = {}
    try:
        sent = [_u8(b"first"), _u8(b""), _u8(bytes(range(256)) * 300)]
        bufs = broadcast_buffers(sent if rank == SRC else None, group, SRC)
        got["buffers"] = [bytes(b.numpy()) for b in bufs]
        # the source has nothing: it gets [], the others raise its reason
        try:
            reason = "no KV arrived" if rank == SRC else None
            got["failure"] = broadcast_buffers(reason, group, SRC, what="the KV")
        except TransferError as exc:
            got["failure"] = str(exc)
        if rank == SRC:  # more than a header holds: refused before any collective
            try:
                broadcast_buffers([_u8(b"")] * (MAX_BUFFERS + 1), group, SRC)
            except ValueError as exc:
                got["too_many"] = str(exc)
        # Last: a buffer over a receiver's limit is refused before anything is allocated.
        # The receivers leave the collective, so the source's send of it fails (they exit).
        if rank == SRC:
            try:
                broadcast_buffers([_u8(b"x" * 100)], group, SRC)
            except RuntimeError:
                got["limit"] = "the receivers left"
        else:
            try:
                broadcast_buffers(None, group, SRC, max_bytes=10)
            except TransferError as exc:
                got["limit"] = str(exc)
            return
    finally:
        out[rank] = got
        if rank != SRC:
            dist.destroy_process_group()


@pytest.mark.forked
def test_buffers_reasons_and_limits_reach_every_rank() -> None:
    world = 3
    with mp.Manager() as manager:
        out = manager.dict()
        args = (world, _free_port(), out)
        mp.start_processes(_worker, args=args, nprocs=world, join=True, start_method="spawn")
        results = dict(out)
    gc.collect()
    expected = [b"first", b"", bytes(range(256)) * 300]
    for rank in range(world):
        got = results[rank]
        assert got["buffers"] == expected, rank
        if rank == SRC:
            assert got["failure"] == [] and "at most" in got["too_many"]
            assert got["limit"] == "the receivers left"
        else:
            assert got["failure"] == "the KV from rank 1 failed: no KV arrived"
            assert "100 bytes (limit 10)" in got["limit"]
