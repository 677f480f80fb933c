"""``wire.host_staging.StagedRows`` on CPU tensors: the path the capture hook takes every
step (on CUDA the same code pins the buffer and records an event: tests/gpu)."""

from __future__ import annotations

import itertools

import pytest
import torch

from vllm_kvbridge.wire.host_staging import StagedRows


def _hidden(rows: int = 10, dim: int = 6) -> torch.Tensor:
    return torch.arange(rows * dim, dtype=torch.float32).view(rows, dim)


def test_each_span_comes_back_exact_in_order_as_its_own_tensor() -> None:
    hidden = _hidden()
    spans = {"r7": (7, 10), "r0": (0, 2), "r4": (4, 5)}
    staged = StagedRows(hidden, spans)
    assert staged.ready() and not staged.pinned  # a CPU source: no event, no pinning
    out = staged.take()
    assert [(k, t.shape[0]) for k, t in out.items()] == [("r7", 3), ("r0", 2), ("r4", 1)]
    for key, (a, b) in spans.items():
        assert torch.equal(out[key], hidden[a:b])
    # Each is its own storage: one request's rows never keep another's (or the step's) alive.
    ptrs = {t.untyped_storage().data_ptr() for t in out.values()}
    assert len(ptrs) == 3 and hidden.untyped_storage().data_ptr() not in ptrs


def test_the_rows_are_copied_when_staged_not_when_taken() -> None:
    hidden = _hidden()
    staged = StagedRows(hidden, {0: (1, 3)})
    want = hidden[1:3].clone()
    hidden.zero_()  # the model's buffer is reused by the next step
    assert torch.equal(staged.take()[0], want)


def test_empty_spans_and_no_spans() -> None:
    hidden = _hidden()
    assert StagedRows(hidden, {}).take() == {}
    out = StagedRows(hidden, {0: (3, 3), 1: (2, 4)}).take()
    assert out[0].shape == (0, 6) and torch.equal(out[1], hidden[2:4])


def test_take_is_once_and_bad_spans_are_refused() -> None:
    staged = StagedRows(_hidden(), {0: (0, 1)})
    staged.take()
    with pytest.raises(RuntimeError, match="twice"):
        staged.take()
    for span in [(-1, 2), (3, 2), (0, 11)]:
        with pytest.raises(ValueError, match="outside"):
            StagedRows(_hidden(), {0: span})


def test_to_device_on_a_cpu_device_is_the_host_tensor() -> None:
    from vllm_kvbridge.wire.host_staging import to_device

    index = torch.arange(5)
    assert to_device(index, "cpu") is index


def test_tensors_viewing_one_buffer_move_in_one_copy_each_exact() -> None:
    from vllm_kvbridge.wire import KVCacheTransferData, decode_packed, encode
    from vllm_kvbridge.wire.host_staging import tensors_to_device

    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(5, 2, 8, generator=g) for _ in range(3)]
    vs = [torch.randn(5, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3)]
    data = KVCacheTransferData(
        request_id="r", layer_blocks={"key_cache": ks, "value_cache": vs}, block_ids=[0], seq_len=5
    )
    got = decode_packed(memoryview(bytearray(encode(data).to_bytes())), copy=False)
    tensors = [*got.key_cache, *got.value_cache, None]
    # Decoded in place: every tensor views the one received buffer.
    assert len({t.untyped_storage().data_ptr() for t in tensors if t is not None}) == 1
    same = tensors_to_device(tensors, "cpu")  # already there: the same tensors
    assert all(x is y for x, y in zip(same, tensors, strict=True))
    moved = tensors_to_device(tensors, "cpu", copy=True)  # the staged path (CUDA's, unpinned)
    assert moved[-1] is None
    for src, dst, want in zip(tensors, moved, [*ks, *vs], strict=False):
        assert dst.dtype == want.dtype and torch.equal(dst, want)
        assert dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    # One staging copy for the whole buffer: the moved tensors share one new storage.
    assert len({t.untyped_storage().data_ptr() for t in moved if t is not None}) == 1


def test_tensors_to_device_keeps_tensors_of_other_buffers_and_odd_ones_apart() -> None:
    from vllm_kvbridge.wire.host_staging import tensors_to_device

    a, b = torch.arange(12.0).view(3, 4), torch.arange(6, dtype=torch.int32)
    strided = torch.arange(20.0).view(4, 5)[:, 1:3]  # not contiguous: moved on its own
    moved = tensors_to_device([a[1:], b, strided, a[:1]], "cpu", copy=True)
    assert torch.equal(moved[0], a[1:]) and torch.equal(moved[1], b) and torch.equal(moved[2], strided)
    assert torch.equal(moved[3], a[:1])
    assert moved[0].untyped_storage().data_ptr() == moved[3].untyped_storage().data_ptr()


def test_kv_pairs_keep_their_order_shapes_and_dtypes() -> None:
    from vllm_kvbridge.wire.host_staging import pairs_to_device

    buf = torch.arange(64, dtype=torch.float32)
    pairs = [(buf[0:8].view(2, 4), buf[16:22].view(3, 2)), (buf[32:36], buf[48:64].view(torch.float16))]
    same = pairs_to_device(pairs, "cpu")
    assert all(a is b for p, q in zip(pairs, same, strict=True) for a, b in zip(p, q, strict=True))
    # The meta device runs the staged path without data: order, shapes and dtypes survive.
    meta = pairs_to_device(pairs, "meta")
    for (k, v), (mk, mv) in zip(pairs, meta, strict=True):
        assert mk.is_meta and (mk.shape, mk.dtype, mv.shape, mv.dtype) == (k.shape, k.dtype, v.shape, v.dtype)


# -- the staging pool's pinned arena: its bookkeeping (CUDA pins it: tests/gpu) ---------------
def test_the_buddy_allocator_splits_merges_and_never_hands_out_more_than_its_arena() -> None:
    from vllm_kvbridge.wire.pinned_pool import BuddyAllocator
    from vllm_kvbridge.wire.staging import MIN_BUFFER as M

    buddy = BuddyAllocator(5 * M + 123)  # whole blocks only: 5 MiB in two parts, 4 + 1
    assert buddy.total == 5 * M and buddy.parts == [(0, 4 * M), (4 * M, M)] and buddy.largest == 4 * M
    assert buddy.alloc(1) is None  # no part is ready yet
    buddy.add_part(4 * M, M)  # the smallest part is made ready first
    assert buddy.alloc(1) == 4 * M and buddy.alloc(1) is None
    buddy.add_part(0, 4 * M)
    assert buddy.alloc(M + 1) == 0  # 2 MiB: the 4 MiB part split, its upper half kept free
    assert buddy.alloc(2 * M) == 2 * M and buddy.alloc(1) is None
    assert buddy.free(0) == 2 * M and buddy.free(2 * M) == 2 * M  # the halves merge again
    assert buddy.alloc(4 * M) == 0
    assert buddy.fits_together([2 * M, 2 * M, M]) and buddy.fits_together([4 * M, 1])
    assert not buddy.fits_together([4 * M, 2 * M]) and not buddy.fits_together([8 * M])
    assert not buddy.fits_together([M, M], parts=[(4 * M, M)])


def test_the_buddy_allocator_under_random_traffic_stays_exact() -> None:
    import random

    from vllm_kvbridge.wire.pinned_pool import BuddyAllocator

    rng = random.Random(7)
    buddy = BuddyAllocator(23 * 4096, min_block=4096)
    for offset, size in buddy.parts:
        buddy.add_part(offset, size)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.5:
            offset = rng.choice(list(live))
            assert buddy.free(offset) == live.pop(offset)
            continue
        want = rng.randint(1, 9 * 4096)
        offset = buddy.alloc(want)
        if offset is None:
            continue
        size = 1 << max(0, want - 1).bit_length() if want > 4096 else 4096
        assert offset % size == 0 and offset + size <= buddy.total
        assert all(offset + size <= o or o + n <= offset for o, n in live.items())  # no overlap
        live[offset] = size
    for offset in list(live):
        buddy.free(offset)
    # Everything merged back: the arena's own parts are free again, whole.
    assert all(buddy.alloc(size) is not None for _, size in buddy.parts)


def test_an_arena_pool_is_bounded_by_its_capacity_and_reuses_its_memory() -> None:
    from vllm_kvbridge.wire.pinned_pool import ArenaPool
    from vllm_kvbridge.wire.staging import MIN_BUFFER as M

    pool = ArenaPool(6 * M + 5, wait=True)  # unpinned here: the same bookkeeping as pinned
    try:
        stats = pool.stats()
        assert stats["allocated"] == 6 * M and stats["in_use"] == 0 and not stats["pinned"]
        a, b = pool.acquire(3 * M), pool.acquire(10)
        assert a is not None and b is not None and len(a.view) == 3 * M and b.nbytes == 10
        a.view[:4] = b"abcd"
        assert bytes(a.tensor[:4].numpy()) == b"abcd"
        assert pool.acquire(4 * M) is None and pool.stats()["full"] == 1  # 4 MiB: taken by a
        assert pool.fits(4 * M) and not pool.fits(4 * M + 1)  # 8 MiB never fits 6 MiB
        assert pool.fits_together([4 * M, 2 * M]) and not pool.fits_together([4 * M, 4 * M])
        with pytest.raises(ValueError, match="never fit"):
            pool.acquire(5 * M)
        a.release()
        a.release()  # idempotent
        b.release()
        sizes = [n * 40_961 % (3 * M) + 1 for n in range(1, 1001)]  # many sizes: nothing grows
        for n in sizes:
            got = pool.acquire(n)
            assert got is not None
            got.release()
        stats = pool.stats()
        assert stats["in_use"] == 0 and stats["allocated"] == 6 * M and stats["peak"] <= 6 * M
        whole = pool.acquire(4 * M)  # merged back: the biggest block is there again
        assert whole is not None
        whole.release()
    finally:
        pool.close()


def test_chunks_cover_the_rows_in_whole_blocks_within_a_slot() -> None:
    from vllm_kvbridge.wire.staging import chunk_rows

    for rows, row_bytes, align, slot in [
        (100, 64, 16, 1000),
        (100, 64, 16, 64 * 48),
        (7, 8, 4, 1 << 20),
        (33, 8, 1, 8),
    ]:
        chunks = chunk_rows(rows, row_bytes, align, slot)
        assert chunks[0][0] == 0 and chunks[-1][1] == rows
        assert all(a == b_prev for (_, b_prev), (a, _) in itertools.pairwise(chunks))
        for start, end in chunks:
            assert start % align == 0 and end > start
            # within the slot, except that one group of ``align`` rows always goes
            assert (end - start) * row_bytes <= max(slot, align * row_bytes)
    assert chunk_rows(100, 64, 16, 64 * 48) == [(0, 48), (48, 96), (96, 100)]
    assert chunk_rows(0, 64, 16, 1000) == []


def test_the_copy_stream_stages_a_cpu_source_in_one_write() -> None:
    from vllm_kvbridge.wire.staging import CopyStream

    stream, calls = CopyStream("cpu"), []
    out = torch.empty(5, 3)
    try:
        stream.stage(out, lambda a, b, dst: (calls.append((a, b)), dst.copy_(torch.ones(b - a, 3))), align=2)
        assert calls == [(0, 5)] and torch.equal(out, torch.ones(5, 3)) and stream.scratch_bytes == 0
    finally:
        stream.close()
