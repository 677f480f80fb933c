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
    spans = [(7, 10), (0, 2), (4, 5)]
    staged = StagedRows(hidden, spans)
    assert staged.ready() and not staged.pinned  # a CPU source: no event, no pinning
    out = staged.take()
    assert [t.shape[0] for t in out] == [3, 2, 1]
    for (a, b), t in zip(spans, out, strict=True):
        assert torch.equal(t, hidden[a:b])
    # Each is its own storage: one request's rows never keep another's (or the step's) alive.
    ptrs = {t.untyped_storage().data_ptr() for t in out}
    assert len(ptrs) == 3 and hidden.untyped_storage().data_ptr() not in ptrs


def test_the_rows_are_copied_when_staged_not_when_taken() -> None:
    hidden = _hidden()
    staged = StagedRows(hidden, [(1, 3)])
    want = hidden[1:3].clone()
    hidden.zero_()  # the model's buffer is reused by the next step
    assert torch.equal(staged.take()[0], want)


def test_empty_spans_and_no_spans() -> None:
    hidden = _hidden()
    assert StagedRows(hidden, []).take() == []
    out = StagedRows(hidden, [(3, 3), (2, 4)]).take()
    assert out[0].shape == (0, 6) and torch.equal(out[1], hidden[2:4])


def test_take_is_once_and_bad_spans_are_refused() -> None:
    staged = StagedRows(_hidden(), [(0, 1)])
    staged.take()
    with pytest.raises(RuntimeError, match="twice"):
        staged.take()
    for span in [(-1, 2), (3, 2), (0, 11)]:
        with pytest.raises(ValueError, match="outside"):
            StagedRows(_hidden(), [span])


def test_to_device_on_a_cpu_device_is_the_host_tensor() -> None:
    from vllm_kvbridge.wire.host_staging import to_device

    index = torch.arange(5)
    assert to_device(index, "cpu") is index
