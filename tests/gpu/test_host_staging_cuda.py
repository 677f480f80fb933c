"""``wire.host_staging.StagedRows`` from a CUDA tensor: pinned staging, a non-blocking copy
and an event; the KV staging pool's pinned arena (``wire.pinned_pool.ArenaPool``):
page-locked once, off the caller's thread, bounded by its budget and really given back
(plain torch, no vLLM: ``make test-gpu`` on any CUDA machine)."""

from __future__ import annotations

import pytest
import torch

from vllm_kvbridge.wire.host_staging import StagedRows

# CUDA is there: tests/gpu/conftest.py fails the run without it (no silent skips).
pytestmark = pytest.mark.cuda


def test_one_non_blocking_copy_into_pinned_memory_completed_by_an_event() -> None:
    hidden = torch.randn(64, 512, device="cuda")
    spans = {"a": (40, 64), "b": (0, 3), "c": (10, 11)}
    want = {key: hidden[a:b].cpu() for key, (a, b) in spans.items()}
    torch.cuda.synchronize()
    # A kernel that spins ~0.5 s runs ahead of the copy on the stream: staging must not wait.
    torch.cuda._sleep(1_000_000_000)
    staged = StagedRows(hidden, spans)
    assert staged.pinned
    assert not staged.ready()  # still behind the spinning kernel: the caller did not block
    out = staged.take()  # waits on the event
    assert staged.ready()
    assert list(out) == list(spans)
    for key, t in out.items():
        assert t.device.type == "cpu" and not t.is_pinned() and torch.equal(t, want[key])


def test_a_thousand_steps_keep_device_and_pinned_memory_flat() -> None:
    hidden = torch.randn(256, 1024, device="cuda")
    for _ in range(20):  # warm the caching allocators
        StagedRows(hidden, {0: (0, 100), 1: (128, 256)}).take()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for i in range(1000):
        out = StagedRows(hidden, {0: (0, 100), 1: (128, 256)}).take()
        assert out[1].shape == (128, 1024)
        if i % 100 == 0:  # each step's rows are exact
            assert torch.equal(out[0], hidden[:100].cpu())
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_a_block_index_goes_to_the_device_without_a_sync() -> None:
    from vllm_kvbridge.wire.host_staging import to_device

    index = torch.arange(1000, dtype=torch.int64)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of work ahead on the stream
    on_device = to_device(index, "cuda")
    after = torch.cuda.Event()
    after.record()
    assert not after.query()  # a pageable copy would have waited for the stream first
    assert torch.equal(on_device.cpu(), index)


def test_a_received_payload_goes_to_the_device_in_one_non_blocking_copy() -> None:
    from vllm_kvbridge.wire import KVCacheTransferData, decode_packed, encode
    from vllm_kvbridge.wire.host_staging import tensors_to_device

    ks = [torch.randn(300, 4, 128) for _ in range(4)]
    vs = [torch.randn(300, 4, 128) for _ in range(4)]
    data = KVCacheTransferData(
        request_id="r", layer_blocks={"key_cache": ks, "value_cache": vs}, block_ids=[0], seq_len=300
    )
    got = decode_packed(memoryview(bytearray(encode(data).to_bytes())), copy=False)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    moved = tensors_to_device([*got.key_cache, *got.value_cache], "cuda")
    after = torch.cuda.Event()
    after.record()
    assert not after.query()  # the transfer is queued behind the kernel: nobody waited
    assert len({t.untyped_storage().data_ptr() for t in moved}) == 1  # one device copy
    for t, want in zip(moved, [*ks, *vs], strict=True):
        assert t.is_cuda and torch.equal(t.cpu(), want)


def _pinned_by_torch() -> int:
    """Bytes torch's caching pinned allocator holds (``torch.cuda.host_memory_stats``)."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    return int(stats.get("allocated_bytes.current", stats.get("allocated_bytes.all.current", 0)))


def test_the_staging_arena_is_pinned_once_bounded_and_really_given_back() -> None:
    import time

    from vllm_kvbridge.wire.pinned_pool import ArenaPool
    from vllm_kvbridge.wire.staging import MIN_BUFFER as M

    torch.cuda.synchronize()
    torch_pinned = _pinned_by_torch()
    t0 = time.perf_counter()
    pool = ArenaPool(64 * M + 3 * M, torch.device("cuda"))  # returns at once: pinned by its thread
    started = time.perf_counter() - t0
    assert pool.wait_ready(60) and pool.error is None
    pinned_after = time.perf_counter() - t0
    print(f"\narena of 67 MiB: constructor {started * 1e3:.2f} ms, pinned after {pinned_after * 1e3:.1f} ms")
    try:
        stats = pool.stats()
        assert stats["pinned"] and stats["allocated"] == 67 * M
        buf = pool.acquire(16 * M)
        assert buf is not None and buf.tensor.is_pinned()
        src = torch.randn(4 * M, device="cuda")  # 16 MiB
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of work ahead on the stream
        buf.tensor.view(torch.float32).copy_(src, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        assert not copied.query()  # page-locked: the copy is queued, the caller did not wait
        copied.synchronize()
        assert torch.equal(buf.tensor.view(torch.float32), src.cpu())
        buf.release()
        for n in range(1, 1001):  # many sizes: the arena neither grows nor leaks
            got = pool.acquire(n * 523_249 % (40 * M) + 1)
            assert got is not None
            got.release()
        stats = pool.stats()
        assert stats["in_use"] == 0 and stats["allocated"] == 67 * M and stats["full"] == 0
        assert _pinned_by_torch() == torch_pinned  # torch's pinned cache was never used
        arena = pool._arena
    finally:
        pool.close()
    assert not arena.is_pinned()  # unregistered: the pinned bytes went back
