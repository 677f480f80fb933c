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

Each test runs both ways a V2 step ends its connector work: vLLM 0.32's (and 0.33's without
a drafter), where ``post_forward`` calls ``wait_for_save`` then ``get_transfer_results``,
and vLLM 0.33's with a speculator, where ``post_forward(..., defer_finalize=True)`` only
collects the transfer results and ``finalize_step()`` runs ``wait_for_save`` after the
drafter (:func:`end_step`).
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_fixtures import reference_gather
from runner_fixtures import kv_receiver, kv_sender_settings, settled_status, shm_entries, shm_namespace
from scheduler_fixtures import add_request, make_scheduler

NAMESPACE = shm_namespace("v2")
SETTINGS = kv_sender_settings(NAMESPACE)
LAYER = "model.layers.0.self_attn.attn"
#: A block size vLLM's CPU attention backend takes without splitting (MultipleOf(32)).
BLOCK = 32
#: How a V2 step ends its connector work (see :func:`end_step`).
FINALIZE = ["post_forward", "deferred"]


class _Deferring033:
    """vLLM 0.33.0's ``ActiveKVConnector.post_forward(finished_req_ids, defer_finalize)`` and
    ``finalize_step()`` (``vllm/v1/worker/gpu/kv_connector.py``), line for line, over the
    installed wrapper's state: the installed 0.32 wrapper has neither."""

    def __init__(self, active: Any) -> None:
        self.active = active

    def post_forward(self, finished_req_ids: set[str], defer_finalize: bool = False) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        a = self.active
        if a._disabled:
            return None
        if a._pending_load_kwargs is not None:
            a._start_load_kv()
        output = KVConnectorOutput()
        if not defer_finalize:
            a.kv_connector.wait_for_save()
        transfer_results = a.kv_connector.get_transfer_results(finished_req_ids)
        output.finished_sending = transfer_results.finished_sending or None
        output.finished_recving = transfer_results.finished_recving or None
        output.failed_recving = transfer_results.failed_recving
        output.invalid_block_ids = a.kv_connector.get_block_ids_with_load_errors()
        output.kv_connector_stats = a.kv_connector.get_kv_connector_stats()
        output.kv_cache_events = a.kv_connector.get_kv_connector_kv_cache_events()
        output.kv_connector_worker_meta = a.kv_connector.build_connector_worker_meta()
        if not defer_finalize:
            a.kv_connector.clear_connector_metadata()
        return output

    def finalize_step(self) -> None:
        a = self.active
        if a._disabled:
            return
        a.kv_connector.wait_for_save()
        a.kv_connector.clear_connector_metadata()


def end_step(active: Any, finished_req_ids: set[str], finalize: str) -> Any:
    """The end of a V2 step's connector work, after sampling; returns the step's
    ``KVConnectorOutput``. ``"post_forward"``: vLLM 0.32's ``sample_tokens`` (and 0.33's
    without a speculator). ``"deferred"``: vLLM 0.33.0's ``GPUModelRunner.sample_tokens``
    (``vllm/v1/worker/gpu/model_runner.py``) with a speculator: ``post_forward(
    finished_req_ids, defer_finalize=True)`` right after sampling, then
    ``postprocess_sampled`` and the drafter's ``propose``, then ``finalize_step()``. The
    installed wrapper's own methods when it has them (vLLM >= 0.33), else 0.33's replayed."""
    if finalize == "post_forward":
        return active.post_forward(finished_req_ids)
    assert finalize == "deferred", finalize
    defers = "defer_finalize" in inspect.signature(active.post_forward).parameters
    wrapper = active if defers else _Deferring033(active)
    output = wrapper.post_forward(finished_req_ids, defer_finalize=True)
    # (vLLM 0.33: postprocess_sampled and the drafter run here, nothing of the connector's.)
    wrapper.finalize_step()
    return output


def _v2_step(scheduler, active, finalize: str, sample_token: int = 11):
    """One engine step as V2 runs it: schedule, the wrapper around the 'forward', update."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    held = {
        spec.req_id: tuple(scheduler.kv_cache_manager.get_block_ids(spec.req_id)[0])
        for spec in out.kv_connector_metadata.sends
    }
    if out.total_num_scheduled_tokens == 0:
        # V2's execute_model: no forward, the wrapper's no_forward (never deferred).
        result = active.no_forward(out)
        scheduler.update_from_output(out, result)
        return out, held, result.kv_connector_output
    active.pre_forward(out)
    active.finish_forward()
    connector_output = end_step(active, out.finished_req_ids, finalize)
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


@pytest.mark.parametrize("finalize", FINALIZE)
def test_v2_wrapper_sends_the_cache_content_and_returns_the_blocks(
    tiny_model_dir: Path, finalize: str
) -> None:
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
        # on_finish (blocks held for the send), prefill_finished (sent while running, and
        # still running when "fin" ends: that step has a forward), and one that opts out.
        add_request(scheduler, "fin", list(range(100, 137)), 4)
        add_request(scheduler, "pf", list(range(300, 350)), 8, trigger="prefill_finished")
        add_request(scheduler, "none", list(range(500, 520)), 2, send_kv=False)
        sends, sent_at, released_at = {}, {}, {}
        for i in range(50):
            if (
                not scheduler.requests
                and not scheduler.finished_req_ids
                and not scheduler.connector.connector_scheduler.held
            ):
                break
            out, held, connector_output = _v2_step(scheduler, active, finalize)
            for send in out.kv_connector_metadata.sends:
                sends[send.req_id] = (send, held[send.req_id])
                sent_at[send.req_id] = (i, out.total_num_scheduled_tokens > 0)
            for rid in (connector_output.finished_sending if connector_output else None) or ():
                released_at[rid] = i
        assert sorted(sends) == ["fin", "pf"], sends
        assert list(released_at) == ["fin"]  # only the on_finish send held its blocks past the finish
        # Its gather ran in wait_for_save of a step with a forward. vLLM 0.33 with
        # defer_finalize collects transfer results (get_finished) before finalize_step's
        # wait_for_save, so those blocks go back one step later: never before the gather.
        step, forward = sent_at["fin"]
        assert forward
        assert released_at["fin"] == step + (finalize == "deferred")
        assert not scheduler.requests and not scheduler.connector.connector_scheduler.held
        for rid, (send, blocks) in sends.items():
            assert send.block_ids[0] == blocks[: math.ceil(send.num_tokens / BLOCK)]
            data, _ = receiver.receive_kv_cache_for_request(rid)
            keys, values = reference_gather(cache, sender.layout, list(send.block_ids[0]), send.num_tokens)
            assert data.seq_len == send.num_tokens
            assert torch.equal(data.key_cache[0], keys) and torch.equal(data.value_cache[0], values)
            del data
        assert sends["fin"][0].num_tokens == 37 + 4 - 1  # the last token is never fed back
        assert sends["pf"][0].num_tokens == 50
        status = settled_status(sender.status, ["fin", "pf", "none"])
        assert [status[r]["kv"] for r in ("fin", "pf", "none")] == ["done", "done", "unknown"]
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        receiver.shutdown()
        worker.shutdown()
    assert shm_entries(NAMESPACE) == []


@pytest.mark.parametrize("finalize", FINALIZE)
def test_a_send_the_connector_cannot_gather_fails_and_still_returns_the_blocks(
    tiny_model_dir: Path, finalize: str
) -> None:
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
            if not scheduler.requests and not scheduler.connector.connector_scheduler.held:
                break
            _out, _held, connector_output = _v2_step(scheduler, active, finalize)
            released |= set((connector_output.finished_sending if connector_output else None) or ())
        assert released == {"big"} and not scheduler.connector.connector_scheduler.held
        status = worker.kv_sender.status(["big"])["big"]["kv"]
        assert status.startswith("failed: gather failed"), status
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        worker.shutdown()
    assert shm_entries(NAMESPACE) == []


pytestmark = pytest.mark.forked
