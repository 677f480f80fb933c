"""The staged KV send path on CUDA (issue 14 item 1): gather on the device, a non-blocking copy
into the pinned staging pool on a side stream, a CUDA event the I/O thread waits on.

Plain torch and a real shared-memory edge, no vLLM (``make test-gpu`` on any CUDA machine).
The caches are what vLLM 0.32's CUDA backends hand the runner: per layer a
``[num_blocks, heads, block, 2*head_dim]`` logical view, K then V packed in the last dim,
over the HND (FlashInfer) or NHD (FlashAttention) physical order.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.layout import packed_layout
from vllm_kvbridge.kv.manager import KVTransferManager

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 4, 64, 4, 16, 64
SEQ = 7 * BLOCK + 5


def _caches(order: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(LAYERS):
        if order == "LBHNC":  # HND: the logical view is the physical one
            t = torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=gen)
        else:  # NHD: physical [B, N, H, C], viewed as [B, H, N, C]
            t = torch.randn(BLOCKS, BLOCK, HEADS, 2 * HEAD, generator=gen).permute(0, 2, 1, 3)
        out.append(t.to(torch.bfloat16).to("cuda"))
    return out


def _reference(cache: torch.Tensor, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    pages = cache.cpu()[block_ids]  # [nb, H, N, 2D]
    tokens = pages.permute(0, 2, 1, 3).reshape(-1, HEADS, 2 * HEAD)[:SEQ]
    return tokens[..., :HEAD], tokens[..., HEAD:]


def _edge(ns: str) -> tuple[KVTransferManager, KVTransferManager]:
    shared = {"connector_config": {"namespace": ns}}
    sender = KVTransferManager(
        KVTransferConfig(need_send_cache=True, stage_id=0, to_stage=1, staging_bytes=256 << 20, **shared),
        num_kv_heads=HEADS,
    )
    receiver = KVTransferManager(
        KVTransferConfig(need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=20, **shared),
        num_kv_heads=HEADS,
    )
    return sender, receiver


def _send(sender: KVTransferManager, caches, rid: str, block_ids: list[int], order: str) -> None:
    sender.layout = packed_layout(HEADS, HEAD, BLOCK, torch.bfloat16, physical_order=order)
    info = {rid: {"block_ids": block_ids, "seq_len": SEQ, "blocks_held": True}}
    assert sender.handle_finished_requests_kv_transfer(info, caches, BLOCK, "auto") == [rid]


def _until_done(sender: KVTransferManager, rid: str) -> None:
    end = time.monotonic() + 30
    while True:
        done, failed = sender.get_finished()
        assert not failed, sender.send_failure_reason(rid)
        if rid in done:
            return
        assert time.monotonic() < end
        time.sleep(0.005)


@pytest.mark.parametrize("order", ["LBHNC", "LBNHC"])
def test_staged_gather_from_a_cuda_cache_equals_the_cpu_reference(order: str) -> None:
    caches = _caches(order)
    block_ids = [int(b) for b in torch.randperm(BLOCKS)[:8]]
    sender, receiver = _edge(f"gpustg{order}{os.getpid()}")
    try:
        _send(sender, caches, "r", block_ids, order)
        _until_done(sender, "r")
        data, _ = receiver.receive_kv_cache_for_request("r")
        for layer, cache in enumerate(caches):
            k, v = _reference(cache, block_ids)
            assert torch.equal(data.key_cache[layer], k) and torch.equal(data.value_cache[layer], v)
        stats = sender.staging_stats()
        assert stats is not None and stats["pinned"] and stats["bypassed"] == 0
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_the_model_thread_does_not_wait_for_the_copy_and_the_blocks_wait_for_its_event() -> None:
    caches = _caches("LBHNC")
    block_ids = list(range(8))
    sender, receiver = _edge(f"gpustgev{os.getpid()}")
    try:
        _send(sender, caches, "warm", block_ids, "LBHNC")  # pools and allocator warmed
        _until_done(sender, "warm")
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of work ahead of the gather on the stream
        _send(sender, caches, "r", block_ids, "LBHNC")
        # The call returned with the copy still queued: the blocks must stay held.
        assert sender.copies_in_flight({"r"}) == {"r"}
        _until_done(sender, "r")  # the I/O thread waited on the event, then published
        assert sender.copies_in_flight({"r"}) == set()
        data, _ = receiver.receive_kv_cache_for_request("r")
        k, v = _reference(caches[0], block_ids)
        assert torch.equal(data.key_cache[0], k) and torch.equal(data.value_cache[0], v)
    finally:
        receiver.shutdown()
        sender.shutdown()


def test_a_thousand_staged_sends_keep_device_and_pinned_memory_flat() -> None:
    caches = _caches("LBHNC")
    sender, receiver = _edge(f"gpustgleak{os.getpid()}")
    try:
        for i in range(20):  # warm up
            _send(sender, caches, f"w{i}", [i % BLOCKS, (i + 9) % BLOCKS, 3, 4, 5, 6, 7, 8], "LBHNC")
            _until_done(sender, f"w{i}")
            receiver.receive_kv_cache_for_request(f"w{i}")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for i in range(1000):
            rid = f"r{i}"
            _send(sender, caches, rid, [i % BLOCKS, (i + 9) % BLOCKS, 3, 4, 5, 6, 7, 8], "LBHNC")
            _until_done(sender, rid)
            receiver.receive_kv_cache_for_request(rid)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        stats = sender.staging_stats()
        assert stats is not None and stats["in_use"] == 0 and stats["allocated"] <= stats["capacity"]
    finally:
        receiver.shutdown()
        sender.shutdown()
