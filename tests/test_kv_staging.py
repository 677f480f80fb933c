"""Issue 14 items 1 and 6: the staged send path with CPU tensors (the GPU path's logic).

A finished request's KV is gathered into a buffer of a bounded staging pool through a copy
stream (on CPU: one copy thread, so the copy really runs off the caller's thread and its
fence really completes later); the I/O thread waits on the fence, copies the staged bytes
into the connector's destination and publishes them. Checked here with real shared-memory
connectors, real threads and real receivers:

* the blocks go back to vLLM (``take_released``: ``finished_sending``) only once the copy
  that reads them has completed, never before;
* a full pool keeps a finished request's KV in the engine's blocks (held, counted) and
  gathers it once there is room; a pool that stays full fails it after ``send_timeout``;
* a request the pool can never hold, or one whose blocks cannot be held, goes the direct
  path; every byte arrives exact, and nothing of the pool or the edge is left afterwards.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from kv_sender_fixtures import GatedShm as _GatedShm
from kv_sender_fixtures import read_exact as _read_exact
from kv_sender_fixtures import receiver as _receiver
from kv_sender_fixtures import spec as _spec
from kv_sender_fixtures import status as _status
from kv_sender_fixtures import wait as _wait
from kv_sender_fixtures import worker as _worker
from runner_fixtures import shm_entries, shm_namespace

from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.runner.kv_sender import WorkerKVSender
from vllm_kvbridge.wire.staging import MIN_BUFFER, CopyStream, StagingPool

pytestmark = pytest.mark.forked


def _released_after_steps(sender: WorkerKVSender, count: int = 1) -> set[str]:
    """Engine steps until the blocks of ``count`` requests went back; which ones."""
    released: set[str] = set()
    _wait(lambda: (sender.send([]), released.update(sender.take_released()))[0] or len(released) >= count)
    return released


def _staging(sender: WorkerKVSender) -> dict:
    stats = sender.manager.staging_stats()
    assert stats is not None, "the staged path is not in use"
    return stats


# -- the pool and the copy stream ------------------------------------------------------------
def test_the_pool_is_bounded_reuses_its_buffers_and_refuses_what_never_fits() -> None:
    pool = StagingPool(4 * MIN_BUFFER, pinned=False)
    a = pool.acquire(10)
    assert a is not None and a.nbytes == 10 and len(a.view) == 10
    ptr = a.tensor.data_ptr()
    a.release()
    a.release()  # idempotent
    b = pool.acquire(MIN_BUFFER)  # same size class: the same memory again (pinning is slow)
    assert b is not None and b.tensor.data_ptr() == ptr
    c = pool.acquire(2 * MIN_BUFFER)
    assert c is not None and pool.stats()["in_use"] == 3 * MIN_BUFFER
    assert pool.acquire(MIN_BUFFER + 1) is None  # needs 2 MiB, 1 MiB left
    assert pool.stats()["full"] == 1
    assert not pool.fits(4 * MIN_BUFFER + 1)
    with pytest.raises(ValueError, match="never fit"):
        pool.acquire(4 * MIN_BUFFER + 1)
    b.release()
    c.release()
    # Kept buffers of other sizes are freed to make room: allocation stays within capacity.
    d = pool.acquire(4 * MIN_BUFFER)
    assert d is not None
    stats = pool.stats()
    assert stats["allocated"] == stats["in_use"] == 4 * MIN_BUFFER and stats["peak"] == 4 * MIN_BUFFER
    d.release()
    for n in range(1, 1001):  # many transfers of varied sizes: nothing leaks
        got = pool.acquire(n * 4099 % (2 * MIN_BUFFER) + 1)
        assert got is not None
        got.release()
    stats = pool.stats()
    assert stats["in_use"] == 0 and stats["allocated"] <= pool.capacity


def test_the_copy_stream_runs_copies_in_order_off_the_callers_thread() -> None:
    stream = CopyStream("cpu")
    gate, order = threading.Event(), []
    try:
        first = stream.submit(lambda: (gate.wait(10), order.append(1)))
        second = stream.submit(lambda: order.append(threading.current_thread().name))
        assert not first.done() and not second.done()  # the copy thread waits at the gate
        with pytest.raises(TimeoutError):
            second.wait(0.05)
        gate.set()
        second.wait(5)
        assert first.done() and order == [1, "kvbridge-kv-copy"]

        failed = stream.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.wait(5)  # whoever waits learns why the copy failed
        inline = stream.submit(lambda: order.append("inline"), inline=True)
        assert inline.done() and order[-1] == "inline"
    finally:
        gate.set()
        stream.close()


# -- the sender --------------------------------------------------------------------------------
def test_blocks_go_back_only_once_the_staged_copy_has_read_them() -> None:
    ns = shm_namespace("stgorder")
    sender = _worker(ns, staging_bytes=8 * MIN_BUFFER)
    stall = threading.Event()
    try:
        sender.send([_spec("A")])
        _wait(lambda: _status(sender, "A") == "done")
        assert sender.take_released() == {"e-A"}
        # A copy ahead of B's on the copy stream that does not finish until the test says so.
        sender.manager._stager.stream.submit(lambda: stall.wait(30))
        sender.send([_spec("B")])
        assert sender.copying() == 1 and sender.manager.copies_in_flight({"e-B"}) == {"e-B"}
        for _ in range(5):  # engine steps while the copy waits: the blocks stay held
            sender.send([], idle=True)
            assert sender.take_released() == set()
        assert _status(sender, "B") == "pending"
        stall.set()
        released: set[str] = set()
        _wait(lambda: released.update(sender.take_released()) or "e-B" in released)
        assert released == {"e-B"} and sender.copying() == 0
        _wait(lambda: _status(sender, "B") == "done")
        with _receiver(ns) as receiver:
            _read_exact(receiver, "A")
            _read_exact(receiver, "B")
        assert _staging(sender)["in_use"] == 0
    finally:
        stall.set()
        sender.shutdown()
    assert shm_entries(ns) == []


def _stalled_pool(ns: str, stall: threading.Event, **kv: object) -> WorkerKVSender:
    """A sender whose pool holds one request, filled by A's copy, which waits for ``stall``
    behind a copy ahead of it on the copy stream (warmed by a first request W)."""
    sender = _worker(ns, staging_bytes=MIN_BUFFER, **kv)
    sender.send([_spec("W")])
    _wait(lambda: _status(sender, "W") == "done")
    assert sender.take_released() == {"e-W"}
    sender.manager._stager.stream.submit(lambda: stall.wait(30))
    sender.send([_spec("A")])
    return sender


def test_a_full_pool_holds_the_kv_in_the_engine_and_gathers_it_once_there_is_room() -> None:
    """One buffer's worth of pool, taken by A while its copy waits: B finds no room, is held
    (not gathered, blocks not given back) and counted; once A's bytes reached the edge the
    buffer is free and the next engine step gathers B."""
    ns = shm_namespace("stgfull")
    stall = threading.Event()
    sender = _stalled_pool(ns, stall)
    try:
        sender.send([_spec("B")])
        assert sender.held() == 1 and sender.take_released() == set()
        stats = _staging(sender)
        assert stats["full"] >= 1 and stats["deferred"] >= 1 and stats["in_use"] == MIN_BUFFER
        assert _status(sender, "A") == _status(sender, "B") == "pending"
        stall.set()
        assert _released_after_steps(sender, 2) == {"e-A", "e-B"} and sender.held() == 0
        _wait(lambda: _status(sender, "A") == _status(sender, "B") == "done")
        with _receiver(ns) as receiver:
            for rid in ("W", "A", "B"):
                _read_exact(receiver, rid)
        assert _staging(sender)["in_use"] == 0 and _staging(sender)["bypassed"] == 0
    finally:
        stall.set()
        sender.shutdown()
    assert shm_entries(ns) == []


def test_a_pool_that_stays_full_fails_the_held_request_after_send_timeout() -> None:
    ns = shm_namespace("stgtimeout")
    stall = threading.Event()
    sender = _stalled_pool(ns, stall, send_timeout=0.5)
    try:
        sender.send([_spec("B")])
        assert sender.held() == 1
        _wait(lambda: (sender.send([]), sender.held() == 0)[1], timeout=5)  # engine steps
        assert sender.take_released() == {"e-B"}  # failed: its blocks go back ungathered
        why = _status(sender, "B")
        assert why.startswith("failed: KV held") and "no room for it in the staging pool" in why, why
        stall.set()
        _wait(lambda: _status(sender, "A") == "done")
        with _receiver(ns) as receiver:
            _read_exact(receiver, "A")
    finally:
        stall.set()
        sender.shutdown()
    assert shm_entries(ns) == []


def test_the_pool_buffer_goes_back_once_its_bytes_are_on_the_edge() -> None:
    """A slow edge (a publish that waits) holds its own memory, not the pinned pool: the
    staged bytes are copied into the connector's destination and the buffer is free."""
    ns = shm_namespace("stgslow")
    _GatedShm.gate.clear()
    sender = _worker(ns, connector=_GatedShm.name, staging_bytes=MIN_BUFFER)
    try:
        sender.send([_spec("A")])
        _wait(lambda: sender.manager.connector.health()["held_bytes"] > 0)  # A at the gate
        _wait(lambda: _staging(sender)["in_use"] == 0)
        assert _status(sender, "A") == "pending"
        sender.send([_spec("B")])  # room in the pool: gathered at once
        assert sender.held() == 0 and _staging(sender)["full"] == 0
        _GatedShm.gate.set()
        _wait(lambda: _status(sender, "A") == _status(sender, "B") == "done")
        with _receiver(ns) as receiver:
            _read_exact(receiver, "A")
            _read_exact(receiver, "B")
    finally:
        _GatedShm.gate.set()
        sender.shutdown()
    assert shm_entries(ns) == []


def test_what_the_pool_cannot_stage_goes_the_direct_path_exact() -> None:
    """A request bigger than the whole pool, and a running request's send whose blocks vLLM
    frees without asking (copied before ``send`` returns), both arrive exact."""
    ns = shm_namespace("stgdirect")
    tiny = _worker(ns, staging_bytes=1)  # no buffer ever fits
    sender = _worker(ns, staging_bytes=8 * MIN_BUFFER)
    try:
        tiny.send([_spec("big")])
        _wait(lambda: _status(tiny, "big") == "done")
        assert tiny.take_released() == {"e-big"} and _staging(tiny)["bypassed"] == 1
        sender.send([_spec("running", release=False)])
        # staged on the caller's thread: nothing reads the blocks once send returned
        assert sender.manager.copies_in_flight({"e-running"}) == set()
        assert sender.copying() == 0
        _wait(lambda: _status(sender, "running") == "done")
        with _receiver(ns) as receiver:
            _read_exact(receiver, "big")
            _read_exact(receiver, "running")
    finally:
        tiny.shutdown()
        sender.shutdown()
    assert shm_entries(ns) == []


def test_many_staged_sends_leave_no_pool_buffer_or_segment_behind() -> None:
    ns = shm_namespace("stgleak")
    sender = _worker(ns, staging_bytes=2 * MIN_BUFFER)
    n = 200
    try:
        with _receiver(ns) as receiver:
            for i in range(n):
                rid = f"r{i}"
                sender.send([_spec(rid)])
                released = _released_after_steps(sender)
                assert released == {f"e-{rid}"}
                if i % 50 == 0:
                    _read_exact(receiver, rid)
                else:
                    receiver.receive_kv_cache_for_request(rid)
        stats = _staging(sender)
        assert stats["in_use"] == 0 and stats["allocated"] <= 2 * MIN_BUFFER and stats["full"] == 0
    finally:
        sender.shutdown()
    gc.collect()
    assert shm_entries(ns) == []


def test_bench_gpu_path_runs_its_code_on_cpu_and_refuses_cuda_clearly(capsys) -> None:
    """``bench gpu-path`` is for CUDA machines; ``--device cpu`` runs the same code paths
    (no figure is checked: CI never gates on time). Without CUDA it says so."""
    import argparse

    from vllm_kvbridge.bench.gpu_path import format_result, run
    from vllm_kvbridge.cli.main import main

    result = run(argparse.Namespace(device="cpu", tokens="40", repeat=1, json=None))
    rows = {row["path"]: row for row in result["rows"]}
    assert set(rows) == {"staged", "direct"}
    assert rows["staged"]["bytes"] == rows["direct"]["bytes"] > 40 * 28 * 4 * 128 * 2 * 2
    assert all(row["gbps"] > 0 and row["ratio"] > 0 for row in rows.values())
    assert "pinned_d2h" in format_result(result) and all(
        row["ceiling"] == "pinned_d2h" for row in rows.values()
    )
    assert shm_entries(f"benchgpu{os.getpid()}") == []  # the direct path's segments went back
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            main(["bench", "gpu-path", "--repeat", "1"])


def test_a_negative_staging_budget_is_refused_naming_the_key() -> None:
    from vllm_kvbridge.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kv_transfer.staging_bytes: must be >= 0, got -1"):
        KVTransferConfig(need_send_cache=True, to_stage=1, staging_bytes=-1)


# -- the gather through the bounded device scratch (its logic on CPU tensors; CUDA: tests/gpu) --
def _packed_caches(order: str, bpb: int, layers: int = 3, blocks: int = 24) -> tuple[list, object]:
    """Per-layer logical ``[B, H, N, K+V]`` views over a cache stored in physical ``order``
    (vLLM's KVCacheLayout names), ``bpb`` tensor blocks per scheduler block."""
    from vllm_kvbridge.kv.layout import packed_layout

    heads, n, k, v = 4, 4, 8, 6
    dims = {"L": layers, "B": blocks * bpb, "H": heads, "N": n, "C": k + v}
    gen = torch.Generator().manual_seed(11)
    physical = torch.randn(*[dims[d] for d in order], generator=gen).to(torch.bfloat16)
    logical = physical.permute(*[order.index(d) for d in "LBHNC"])
    layout = packed_layout(
        heads, k, n, torch.bfloat16, head_size_v=v, physical_order=order, blocks_per_block=bpb
    )
    return [logical[i] for i in range(layers)], layout


def _packed_reference(cache, layout, block_ids, seq, hs, he):
    k = layout.blocks_per_block
    ids = [b * k + j for b in block_ids for j in range(k)]
    tokens = cache[ids].permute(0, 2, 1, 3).reshape(-1, layout.num_kv_heads, cache.shape[-1])[:seq, hs:he]
    return tokens[..., : layout.head_size], tokens[..., layout.head_size :]


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
@pytest.mark.parametrize("bpb", [1, 2])
def test_a_chunked_gather_of_every_packed_layout_equals_the_whole_one(order: str, bpb: int) -> None:
    """What the CUDA path does through its scratch, chunk by chunk of whole blocks, here on
    CPU tensors: every layout, head slices (TP routes), a last partial block."""
    from vllm_kvbridge.kv.paged import RequestGather
    from vllm_kvbridge.kv.staged import HostGather
    from vllm_kvbridge.wire.kv_format import KEY, VALUE
    from vllm_kvbridge.wire.staging import chunk_rows

    caches, layout = _packed_caches(order, bpb)
    per = layout.tokens_per_block
    block_ids = [17, 3, 9, 0, 22, 5, 11]
    seq = 6 * per + 3
    stream = CopyStream("cpu")
    try:
        for hs, he in [(0, 4), (1, 3)]:
            request = RequestGather(caches, layout, block_ids, seq, head_start=hs, head_end=he)
            host = HostGather(stream, request)
            for layer, cache in enumerate(caches):
                want = _packed_reference(cache, layout, block_ids, seq, hs, he)
                for kind in (KEY, VALUE):
                    row_bytes = request.shape(0, kind)[1] * request.shape(0, kind)[2] * 2
                    for slot in (1, 2 * per * row_bytes + 5, 1 << 20):
                        out = torch.full(request.shape(0, kind), float("nan"), dtype=torch.bfloat16)
                        for start, end in chunk_rows(seq, row_bytes, per, slot):
                            host.write_rows(layer, kind, start, end, out[start:end])
                        assert torch.equal(out, want[kind]), (order, bpb, hs, layer, kind, slot)
                    fill = host.fills(kind)[layer]  # what the packer calls: one write on CPU
                    assert fill.device.type == "cpu" and tuple(fill.shape) == request.shape(0, kind)
                    out = torch.empty(request.shape(0, kind), dtype=torch.bfloat16)
                    fill.fill_into(out)
                    assert torch.equal(out, want[kind])
    finally:
        stream.close()


def test_cpu_caches_keep_the_pageable_pool_and_the_device_scratch_is_bounded() -> None:
    from vllm_kvbridge.kv.staged import Stager, scratch_bytes_for
    from vllm_kvbridge.wire.staging import DEVICE_SCRATCH_BYTES, StagingPool

    stager = Stager(8 * MIN_BUFFER, torch.device("cpu"))
    try:
        assert isinstance(stager.pool, StagingPool) and not stager.pool.pinned
        assert stager.stats()["scratch_bytes"] == 0  # no device, no scratch
    finally:
        stager.close()
    # The scratch is a slice of the budget with a ceiling, whatever the requests.
    assert scratch_bytes_for(1) == MIN_BUFFER and scratch_bytes_for(8 * MIN_BUFFER) == MIN_BUFFER
    assert scratch_bytes_for(64 * MIN_BUFFER) == 8 * MIN_BUFFER
    assert scratch_bytes_for(64 << 30) == DEVICE_SCRATCH_BYTES
