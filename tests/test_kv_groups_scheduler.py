"""Several KV cache groups in vLLM's real V1 scheduler (no engine): with KVBridgeConnector
vLLM keeps its hybrid allocator on, and a finished request's send names, per group, the
blocks that group holds: the whole sequence for full attention, the window for sliding
layers (whose earlier blocks vLLM gave back: its null block, id 0, stands in the table).
The engine-level check against transformers is tests/test_arch_fidelity.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from runner_fixtures import kv_sender_settings
from scheduler_fixtures import BLOCK, add_request, make_scheduler, step

from vllm_kvbridge.pipeline.sender_info import kv_send_refused
from vllm_kvbridge.runner.connector_scheduler import NULL_BLOCK_ID

SETTINGS = kv_sender_settings("tgroups")
WINDOW = 24


def _hybrid(model_dir: Path, num_blocks: int = 64):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    shape = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    groups = [
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(**shape)),
        KVCacheGroupSpec(
            ["model.layers.0.self_attn.attn"], SlidingWindowSpec(**shape, sliding_window=WINDOW)
        ),
    ]
    # (no prefix caching: these requests carry no block hashes)
    return make_scheduler(
        model_dir, SETTINGS, num_blocks=num_blocks, kv_cache_groups=groups, enable_prefix_caching=False
    )


def test_the_hybrid_allocator_stays_on_with_the_connector(tiny_model_dir: Path) -> None:
    scheduler = _hybrid(tiny_model_dir)
    assert scheduler.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    add_request(scheduler, "r", list(range(100, 140)), 4)
    step(scheduler, lambda rid, i: 11)
    assert len(scheduler.kv_cache_manager.get_block_ids(next(iter(scheduler.requests)))) == 2  # a table each
    groups = scheduler.connector.connector_scheduler.groups
    assert [(g.layers, g.window) for g in groups] == [((1,), None), ((0,), WINDOW)]


@pytest.mark.parametrize("prompt_len", [1, 20, 23, 24, 25, 40, 47, 48, 49, 100])
def test_a_finished_request_sends_each_groups_blocks_from_its_window(
    tiny_model_dir: Path, prompt_len: int
) -> None:
    scheduler = _hybrid(tiny_model_dir)
    add_request(scheduler, "r", list(range(100, 100 + prompt_len)), 4)
    sends = []
    for _ in range(50):
        if not scheduler.requests and not scheduler.finished_req_ids:
            break
        out, _ = step(scheduler, lambda rid, i: 11)
        sends += out.kv_connector_metadata.sends
    [spec] = sends
    n = prompt_len + 4 - 1  # the last sampled token is never fed back
    assert spec.num_tokens == n
    first = max(0, n - (WINDOW - 1))  # what transformers' sliding cache keeps, too
    assert spec.starts == (0, first)
    full, sliding = spec.block_ids
    assert len(full) == len(sliding) == math.ceil(n / BLOCK)
    assert NULL_BLOCK_ID not in full
    # the window's blocks are held; the blocks wholly before it went back
    assert NULL_BLOCK_ID not in sliding[first // BLOCK :]
    assert set(sliding[: first // BLOCK]) <= {NULL_BLOCK_ID}


def test_a_window_that_moved_past_the_tokens_fails_the_request_with_the_reason(tiny_model_dir: Path) -> None:
    """A send whose window names a block vLLM already gave back cannot be gathered: the
    request reads failed (with why) instead of a KV with a null block's bytes in it."""
    from vllm.v1.request import RequestStatus

    scheduler = _hybrid(tiny_model_dir)
    add_request(scheduler, "r", list(range(100, 140)), 8)
    step(scheduler, lambda rid, i: 11)  # the prompt's 40 tokens are computed
    [request] = scheduler.requests.values()
    request.status = RequestStatus.FINISHED_STOPPED  # vLLM's hook as it would call it now
    n = 40
    full = [1, 2, 3]
    gone = [NULL_BLOCK_ID, NULL_BLOCK_ID, 9]  # tokens 17..39 are the window: block 1 is needed
    delay, params = scheduler.connector.request_finished_all_groups(request, (full, gone))
    assert n - (WINDOW - 1) < 2 * BLOCK  # (the window reaches into block 1)
    assert delay is False
    why = kv_send_refused(type("Out", (), {"kv_transfer_params": params})())
    assert why is not None and "no longer held" in why and "sliding-window" in why, params
