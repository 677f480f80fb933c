"""Stage-engine bookkeeping stays bounded (issue 11, case 10).

An abort of a request that already finished (a client that goes away at the last moment,
the orchestrator's timeout) added an id to the engine's aborted set that nothing ever
removed; a long-running ``serve`` grew it for ever.
"""

from __future__ import annotations

import time

from pipeline_fixtures import ROOT

from vllm_kvbridge.config.resolve import resolve
from vllm_kvbridge.pipeline.engines import ExpiringIds, build_engine


def test_aborted_ids_expire_and_are_bounded() -> None:
    ids = ExpiringIds(keep_s=0.2, max_items=100)
    ids.update(f"a{i}" for i in range(1000))
    assert len(ids) == 100 and "a999" in ids and "a0" not in ids
    time.sleep(0.3)
    ids.add("late")
    assert len(ids) == 1 and "late" in ids
    ids.discard("late")
    assert "late" not in ids


def test_ten_thousand_aborts_of_finished_requests_leave_a_diffusion_stage_bounded() -> None:
    stage = resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml").stages[1]
    engine = build_engine(stage)  # the real diffusion stage engine (tiny DiT, shm KV manager)
    try:
        for i in range(20_000):
            engine.abort([f"gone-{i}"])
        assert len(engine._aborted) <= 10_000
    finally:
        engine.close()
