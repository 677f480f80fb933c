"""The scheduler half of KVBridgeConnector inside vLLM's real V1 scheduler (no engine).

Issue 11, case 3: a ``special_token`` trigger seen while its request was preempted (its
blocks freed) produced a send with no blocks; the gather failed, ``sent`` prevented a
retry, and ``request_finished`` still reported "submitted". Whatever step the trigger
lands on, every send must name blocks the request holds at that step, covering its tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from runner_fixtures import kv_sender_settings
from scheduler_fixtures import BLOCK, add_request, make_scheduler, step

SETTINGS = kv_sender_settings("tsched")
TRIGGER, OTHER = 7, 11


def _run(model_dir: Path, trigger_at: int) -> tuple[list, dict, int]:
    """Two long requests on a cache too small for both: the later one is preempted while
    the earlier decodes. Its trigger token is sampled at output index ``trigger_at``."""
    scheduler = make_scheduler(model_dir, SETTINGS, num_blocks=9, enable_prefix_caching=False)
    add_request(scheduler, "a", list(range(100, 120)), 60)
    add_request(scheduler, "b", list(range(200, 220)), 60, trigger="special_token", trigger_token_id=TRIGGER)
    sends, finished, preemptions = [], {}, 0
    for _ in range(400):
        if not scheduler.requests and not scheduler.finished_req_ids:
            break
        out, held = step(scheduler, lambda rid, i: TRIGGER if rid == "b" and i == trigger_at else OTHER)
        preemptions += len(getattr(out, "preempted_req_ids", None) or ())
        sends += [(spec, held[spec.req_id]) for spec in out.kv_connector_metadata.sends]
        for rid, (kind, _) in out.kv_connector_metadata.finished.items():
            finished[rid] = kind
    return sends, finished, preemptions


@pytest.mark.parametrize("trigger_at", range(60))
def test_special_token_sends_only_blocks_the_request_holds(tiny_model_dir: Path, trigger_at: int) -> None:
    sends, finished, _ = _run(tiny_model_dir, trigger_at)
    assert finished.get("b") == "finished"
    [(spec, held)] = [(s, h) for s, h in sends if s.req_id == "b"]  # exactly one send
    assert spec.num_tokens == 20 + trigger_at  # the prompt and the outputs before the trigger
    need = math.ceil(spec.num_tokens / BLOCK)
    assert len(spec.block_ids[0]) == need, spec
    assert spec.block_ids[0] == held[:need], (spec, held)  # blocks the request holds right now


def test_the_scenario_preempts(tiny_model_dir: Path) -> None:
    assert _run(tiny_model_dir, 0)[2] > 0  # otherwise the test above would prove nothing
