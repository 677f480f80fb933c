"""The CUDA-IPC connector between two GPU processes (issue 14 item 4).

Plain torch and real processes, no vLLM (``make test-gpu`` on any CUDA machine): a payload
of CUDA tensors crosses to a spawned receiver bit-exact and lands on its device; the
sender's budget comes back when the receiver acknowledges; a full budget answers ``full``
and has room again after the read; a KV send gathers from a CUDA-layout paged cache
straight into the lent device buffer (no staging pool) and the receiver's KV equals a CPU
reference; 1,000 transfers leave no lent bytes, no shared-memory names and no device
memory behind. Across two GPUs (a receiver given the sender's GPU after its own, as the
resolver pairs them) the payload lands on the receiver's own GPU; and a receive does not
wait for unrelated work queued on the receiver's current stream (a prefetch overlaps the
denoising). The connector's whole contract suite runs on it too
(tests/test_connector_contract.py lists it where CUDA exists).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from vllm_kvbridge.config.gpu_pairing import cuda_ipc_visible_devices
from vllm_kvbridge.connectors.cuda_ipc_devices import normalize_gpu_uuid
from vllm_kvbridge.connectors.registry import create_connector

# CUDA is there: tests/gpu/conftest.py fails the run without it (no silent skips).
pytestmark = pytest.mark.cuda


def _payload(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(64, 8, 128, generator=gen).to(torch.bfloat16).cuda(),
        "ids": torch.arange(seed, seed + 9).cuda(),
        "meta": {"seed": seed},
    }


def _names(token: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f".{token}." in n)


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _child_get(token: str, key: str, seed: int, out, detail: bool = False) -> None:  # type: ignore[no-untyped-def]
    with create_connector("CudaIpcConnector", {"namespace": token}) as conn:
        got = conn.get(0, 1, key, deadline=time.monotonic() + 60)
        want = _payload(seed)
        result = (
            got["k"].device.type,
            torch.equal(got["k"].cpu(), want["k"].cpu()),
            torch.equal(got["ids"].cpu(), want["ids"].cpu()),
            got["meta"],
        )
        if detail:  # which GPU it landed on, and the senders' GPUs this process holds a context on
            result += (_gpu_uuid(got["k"].device.index), conn.health()["peer_gpus"])
        out.put(result)


@contextlib.contextmanager
def _child_env(**env: str) -> Iterator[None]:
    """``env`` for the processes spawned within (CUDA in this one is set up already)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _receive_in_child(token: str, key: str, seed: int, *, detail: bool = False, **env: str) -> tuple:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child_get, args=(token, key, seed, out, detail))
    with _child_env(**env):
        child.start()
    try:
        return out.get(timeout=120)
    finally:
        child.join(timeout=60)


def test_a_payload_crosses_to_another_process_on_the_device_and_the_budget_comes_back() -> None:
    token = "t" + uuid.uuid4().hex[:12]
    with create_connector("CudaIpcConnector", {"namespace": token}) as sender:
        result = sender.put(0, 1, "req0.kv", _payload(1))
        assert result.ok, result.error
        assert sender.health()["held_bytes"] == result.nbytes > 0
        assert _receive_in_child(token, "req0.kv", 1) == ("cuda", True, True, {"seed": 1})
        assert sender.health()["held_bytes"] == 0 and sender.health()["lent"] == 0
    assert _names(token) == []


def test_on_one_gpu_the_receiver_lands_on_the_senders_gpu_with_no_extra_context() -> None:
    token = "t" + uuid.uuid4().hex[:12]
    with create_connector("CudaIpcConnector", {"namespace": token}) as sender:
        assert sender.put(0, 1, "one.kv", _payload(4)).ok
        got = _receive_in_child(token, "one.kv", 4, detail=True)
        assert got == ("cuda", True, True, {"seed": 4}, _gpu_uuid(torch.cuda.current_device()), [])
        assert sender.health()["held_bytes"] == 0
    assert _names(token) == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_across_two_gpus_the_payload_lands_on_the_receivers_own_gpu() -> None:
    """The sender on GPU 0, the receiver pinned to GPU 1 and given GPU 0 after it (what the
    resolver does for a CUDA-IPC edge): found by UUID, copied peer to peer onto GPU 1, and
    the context it opens on GPU 0 reported."""
    token = "t" + uuid.uuid4().hex[:12]
    own, theirs = (f"GPU-{normalize_gpu_uuid(_gpu_uuid(i))}" for i in (1, 0))  # as CUDA takes them
    visible = cuda_ipc_visible_devices(own, theirs)
    assert visible == f"{own},{theirs}"
    with torch.cuda.device(0), create_connector("CudaIpcConnector", {"namespace": token}) as sender:
        result = sender.put(0, 1, "two.kv", _payload(3))
        assert result.ok, result.error
        got = _receive_in_child(token, "two.kv", 3, detail=True, CUDA_VISIBLE_DEVICES=visible)
        assert got == ("cuda", True, True, {"seed": 3}, _gpu_uuid(1), [_gpu_uuid(0)])
        assert sender.health()["held_bytes"] == 0 and sender.health()["lent"] == 0
    assert _names(token) == []


#: Cycles of the unrelated kernel queued before the receive (a few seconds on any GPU).
_SLEEP_CYCLES = 5_000_000_000


def _child_get_behind_sleep(token: str, out) -> None:  # type: ignore[no-untyped-def]
    with create_connector("CudaIpcConnector", {"namespace": token}) as conn:
        warm = conn.get(0, 1, "warm.kv", deadline=time.monotonic() + 60)  # streams, allocator
        del warm
        torch.cuda.synchronize()
        torch.cuda._sleep(_SLEEP_CYCLES)  # the DiT's denoising, say, on the current stream
        slept = torch.cuda.Event()
        slept.record()
        got = conn.get(0, 1, "late.kv", deadline=time.monotonic() + 60)
        # The receive returned while the kernel queued before it still runs: it did not wait
        # for it (the old receive synchronized the current stream, so the kernel was done).
        overlapped = not slept.query()
        x = got["x"]  # complete when get returned: read on the copy's own stream
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            first, last = float(x[0]), float(x[-1])
        out.put((overlapped, slept.query(), first, last))
        torch.cuda.synchronize()


def test_a_receive_does_not_wait_for_work_queued_on_the_receivers_current_stream() -> None:
    token = "t" + uuid.uuid4().hex[:12]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child_get_behind_sleep, args=(token, out))
    with create_connector("CudaIpcConnector", {"namespace": token}) as sender:
        for key, value in (("warm.kv", 1.0), ("late.kv", 2.0)):
            assert sender.put(0, 1, key, {"x": torch.full((1 << 20,), value, device="cuda")}).ok
        child.start()
        try:
            overlapped, slept_before_read, first, last = out.get(timeout=120)
        finally:
            child.join(timeout=60)
        assert overlapped and not slept_before_read
        assert (first, last) == (2.0, 2.0)
    assert _names(token) == []


def test_a_full_budget_answers_full_and_has_room_once_the_receiver_read() -> None:
    token = "t" + uuid.uuid4().hex[:12]
    size = 64 * 8 * 128 * 2 + (1 << 12)
    with create_connector("CudaIpcConnector", {"namespace": token, "pool_bytes": size}) as sender:
        assert sender.put(0, 1, "a.kv", _payload(1)).ok
        refused = sender.put(0, 1, "b.kv", _payload(2))
        assert not refused.ok and refused.full
        assert _receive_in_child(token, "a.kv", 1)[1]
        assert sender.put(0, 1, "b.kv", _payload(2)).ok
        assert _receive_in_child(token, "b.kv", 2)[1]
    assert _names(token) == []


def _child_get_many(token: str, n: int, out) -> None:  # type: ignore[no-untyped-def]
    ok = 0
    with create_connector("CudaIpcConnector", {"namespace": token}) as conn:
        for i in range(n):
            got = conn.get(0, 1, f"r{i}.kv", deadline=time.monotonic() + 60)
            ok += int(got["x"].is_cuda and float(got["x"][0]) == float(i) and float(got["x"][-1]) == float(i))
            del got
    out.put(ok)


def test_a_thousand_transfers_to_another_process_leave_nothing_behind() -> None:
    """Through a budget of 8 payloads, so the sender also waits for room (``full``)."""
    n, numel = 1000, 1 << 16
    token = "t" + uuid.uuid4().hex[:12]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child_get_many, args=(token, n, out))
    with create_connector(
        "CudaIpcConnector", {"namespace": token, "pool_bytes": 8 * (4 * numel + 4096)}
    ) as sender:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        for i in range(8):  # the budget, before anyone reads
            assert sender.put(0, 1, f"r{i}.kv", {"x": torch.full((numel,), float(i), device="cuda")}).ok
        refused = sender.put(0, 1, "r8.kv", {"x": torch.full((numel,), 8.0, device="cuda")})
        assert not refused.ok and refused.full
        child.start()
        for i in range(8, n):
            payload = {"x": torch.full((numel,), float(i), device="cuda")}
            while not (result := sender.put(0, 1, f"r{i}.kv", payload)).ok:
                assert result.full, result.error
                time.sleep(0.001)
        assert out.get(timeout=300) == n
        child.join(timeout=60)
        end = time.monotonic() + 10
        while sender.health()["lent"]:  # the last acknowledgements
            assert time.monotonic() < end, sender.health()
            time.sleep(0.01)
        assert sender.health()["held_bytes"] == 0
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() <= baseline + (1 << 20)
    assert _names(token) == []


def test_a_kv_send_gathers_straight_into_the_lent_device_buffer() -> None:
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.layout import packed_layout
    from vllm_kvbridge.kv.manager import KVTransferManager

    layers, blocks, heads, block, dim, seq = 4, 64, 4, 16, 64, 7 * 16 + 5
    gen = torch.Generator().manual_seed(3)
    caches = [
        torch.randn(blocks, heads, block, 2 * dim, generator=gen).to(torch.bfloat16).cuda()
        for _ in range(layers)
    ]
    token = "t" + uuid.uuid4().hex[:12]
    shared = {"connector": "CudaIpcConnector", "connector_config": {"namespace": token}}
    sender = KVTransferManager(
        KVTransferConfig(need_send_cache=True, stage_id=0, to_stage=1, staging_bytes=256 << 20, **shared),
        num_kv_heads=heads,
    )
    receiver = KVTransferManager(
        KVTransferConfig(need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=20, **shared),
        num_kv_heads=heads,
    )
    try:
        sender.layout = packed_layout(heads, dim, block, torch.bfloat16, physical_order="LBHNC")
        block_ids = [9, 3, 40, 41, 7, 0, 63, 12]
        info = {"r0": {"block_ids": block_ids, "seq_len": seq, "blocks_held": True}}
        assert sender.handle_finished_requests_kv_transfer(info, caches, block, "auto") == ["r0"]
        end = time.monotonic() + 30
        while "r0" not in sender.get_finished()[0]:
            assert time.monotonic() < end, sender.send_failure_reason("r0")
            time.sleep(0.005)
        got, _ = receiver.receive_kv_cache_for_request("r0")
        for layer in range(layers):
            pages = caches[layer].cpu()[block_ids].permute(0, 2, 1, 3).reshape(-1, heads, 2 * dim)[:seq]
            assert torch.equal(got.key_cache[layer].cpu(), pages[..., :dim])
            assert torch.equal(got.value_cache[layer].cpu(), pages[..., dim:])
        stats = sender.staging_stats()  # the gather went to the device buffer, not the pool
        assert stats is None or (stats["bypassed"] == 0 and stats["peak"] == 0)
    finally:
        receiver.shutdown()
        sender.shutdown()
    assert _names(token) == []
