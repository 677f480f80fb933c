"""``wire.host_staging.StagedRows`` on CPU tensors: the path the capture hook takes every
step (on CUDA the same code pins the buffer and records an event: tests/gpu)."""

from __future__ import annotations

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
