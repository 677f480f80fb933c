"""vLLM's Model Runner V2 connector wrapper drives KVBridgeConnector (issue 12, item 4).

V2 (``vllm/v1/worker/gpu/model_runner.py``, vLLM's default wherever Triton exists) needs
Triton, so it cannot run here; what it does with a KV connector is
``vllm/v1/worker/gpu/kv_connector.py``'s ``ActiveKVConnector`` (pure Python):
``register_kv_caches`` once, then per step ``pre_forward`` (bind the scheduler's metadata),
``finish_forward``, ``post_forward`` (``wait_for_save``, ``get_transfer_results``). This
test runs vLLM's real V1 scheduler with the scheduler half of our connector, and vLLM's
V2 wrapper around the worker half with real CPU cache tensors; the model is played by
the test. The KV a receiver gets must equal the cache content of the blocks the request
held, and the scheduler must get the held blocks back only through ``finished_sending``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from kv_fixtures import reference_gather
from runner_fixtures import kv_receiver, kv_sender_settings, shm_entries, shm_namespace
from scheduler_fixtures import add_request, make_scheduler

NAMESPACE = shm_namespace("v2")
SETTINGS = kv_sender_settings(NAMESPACE)
LAYER = "model.layers.0.self_attn.attn"
#: A block size vLLM's CPU attention backend takes without splitting (MultipleOf(32)).
BLOCK = 32


def _v2_step(scheduler, active, sample_token: int = 11):
    """One engine step as V2 runs it: schedule, the wrapper around the 'forward', update."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    held = {
        spec.req_id: tuple(scheduler.kv_cache_manager.get_block_ids(spec.req_id)[0])
        for spec in out.kv_connector_metadata.sends
    }
    active.pre_forward(out)
    active.finish_forward()
    connector_output = active.post_forward(out.finished_req_ids)
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = scheduler.requests[rid]
        sampled.append([sample_token] if req.num_computed_tokens >= req.num_tokens else [])
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        kv_connector_output=connector_output,
    )
    scheduler.update_from_output(out, result)
    return out, held, connector_output


def test_v2_wrapper_sends_the_cache_content_and_returns_the_blocks(tiny_model_dir: Path) -> None:
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from vllm_kvbridge.kv.layout import cpu_layout
    from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

    num_blocks = 24
    scheduler = make_scheduler(
        tiny_model_dir, SETTINGS, num_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=False
    )
    config, kv_cache_config = scheduler.vllm_config, scheduler.kv_cache_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    gen = torch.Generator().manual_seed(12)
    # vLLM's CPU cache per layer: [num_blocks, num_kv_heads, block_size, 2 * head_size].
    cache = torch.randn(num_blocks, spec.num_kv_heads, BLOCK, 2 * spec.head_size, generator=gen)
    worker = KVBridgeConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    assert kv_transfer_state._KV_CONNECTOR_AGENT is None
    kv_transfer_state._KV_CONNECTOR_AGENT = worker  # what ensure_kv_transfer_initialized does
    receiver = kv_receiver(NAMESPACE)
    try:
        active = ActiveKVConnector(config, {LAYER: cache})  # registers the caches
        sender = worker.kv_sender
        assert sender is not None
        isa = _get_attn_isa(spec.dtype, BLOCK, spec.head_size, "auto")
        assert sender.layout == cpu_layout(spec.num_kv_heads, spec.head_size, BLOCK, spec.dtype, isa=isa)
        # on_finish (blocks held for the send), prefill_finished (sent while running), and
        # one that opts out.
        add_request(scheduler, "fin", list(range(100, 137)), 4)
        add_request(scheduler, "pf", list(range(300, 350)), 3, trigger="prefill_finished")
        add_request(scheduler, "none", list(range(500, 520)), 2, send_kv=False)
        sends, released = {}, set()
        for _ in range(50):
            if not scheduler.requests and not scheduler.finished_req_ids and not scheduler.connector._held:
                break
            out, held, connector_output = _v2_step(scheduler, active)
            for send in out.kv_connector_metadata.sends:
                sends[send.req_id] = (send, held[send.req_id])
            released |= set((connector_output.finished_sending if connector_output else None) or ())
        assert sorted(sends) == ["fin", "pf"], sends
        assert released == {"fin"}  # only the on_finish send held its blocks past the finish
        assert not scheduler.requests and not scheduler.connector._held
        for rid, (send, blocks) in sends.items():
            assert send.block_ids == blocks[: math.ceil(send.num_tokens / BLOCK)]
            data, _ = receiver.receive_kv_cache_for_request(rid)
            keys, values = reference_gather(cache, sender.layout, list(send.block_ids), send.num_tokens)
            assert data.seq_len == send.num_tokens
            assert torch.equal(data.key_cache[0], keys) and torch.equal(data.value_cache[0], values)
            del data
        assert sends["fin"][0].num_tokens == 37 + 4 - 1  # the last token is never fed back
        assert sends["pf"][0].num_tokens == 50
        status = sender.status(["fin", "pf", "none"])
        assert [status[r]["kv"] for r in ("fin", "pf", "none")] == ["done", "done", "unknown"]
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        receiver.shutdown()
        worker.shutdown()
    assert shm_entries(NAMESPACE) == []


def test_a_send_the_connector_cannot_gather_fails_and_still_returns_the_blocks(tiny_model_dir: Path) -> None:
    """A gather that fails inside ``wait_for_save`` must not raise into vLLM's step (it would
    take the engine down) and must not keep the blocks: the request's KV reads failed."""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

    scheduler = make_scheduler(
        tiny_model_dir, SETTINGS, num_blocks=24, block_size=BLOCK, enable_prefix_caching=False
    )
    config, kv_cache_config = scheduler.vllm_config, scheduler.kv_cache_config
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    # A cache with fewer blocks than the scheduler hands out: block ids past 3 cannot be read.
    cache = torch.zeros(4, spec.num_kv_heads, BLOCK, 2 * spec.head_size)
    worker = KVBridgeConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    kv_transfer_state._KV_CONNECTOR_AGENT = worker
    try:
        active = ActiveKVConnector(config, {LAYER: cache})
        add_request(scheduler, "big", list(range(100, 300)), 2)  # 7 blocks
        released = set()
        for _ in range(20):
            if not scheduler.requests and not scheduler.connector._held:
                break
            _out, _held, connector_output = _v2_step(scheduler, active)
            released |= set((connector_output.finished_sending if connector_output else None) or ())
        assert released == {"big"} and not scheduler.connector._held
        status = worker.kv_sender.status(["big"])["big"]["kv"]
        assert status.startswith("failed: gather failed"), status
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        worker.shutdown()
    assert shm_entries(NAMESPACE) == []


pytestmark = pytest.mark.forked
