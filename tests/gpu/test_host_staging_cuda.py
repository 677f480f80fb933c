"""``wire.host_staging.StagedRows`` from a CUDA tensor: pinned staging, a non-blocking copy
and an event (plain torch, no vLLM: ``make test-gpu`` on any CUDA machine)."""

from __future__ import annotations

import pytest
import torch

from vllm_kvbridge.wire.host_staging import StagedRows

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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
