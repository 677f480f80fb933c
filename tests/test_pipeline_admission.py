"""Requests a stage could not serve faithfully are refused before they enter the pipeline.

Issue 11, case 5: with ``n > 1`` vLLM runs the samples as child requests sharing the
request's transfer id, so samples 2..n failed on duplicate transfer keys. The shipped
configs are resolved for real; the refusal comes before any stage process starts.
"""

from __future__ import annotations

import pytest
from pipeline_fixtures import ROOT

from vllm_kvbridge.config.resolve import resolve
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.pipeline.admission import check_sampling_params


def test_n_above_one_is_refused_on_stages_that_send_kv_or_payloads() -> None:
    kv = resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml")
    with pytest.raises(ValueError, match=r"n=2 is not supported by stage 0 \(llm_ar\), which sends KV"):
        check_sampling_params(kv, {"n": 2})
    with pytest.raises(ValueError, match="n=3"):
        check_sampling_params(kv, None, {0: {"n": 3}})
    check_sampling_params(kv, {"n": 1, "max_tokens": 4})

    payload = resolve(ROOT / "stage_configs/thinker_talker_full_payload.yaml")
    with pytest.raises(ValueError, match="stage 0"):
        check_sampling_params(payload, {"n": 2})
    talker = payload.stages[-1]
    assert not talker.outputs  # the last stage sends nothing on: several samples are fine there
    check_sampling_params(payload, None, {talker.stage_id: {"n": 2}})


def test_the_pipeline_refuses_before_starting_a_stage() -> None:
    # a model the DiT's KV geometry can be read from (built, cached); no stage starts
    pipe = Pipeline.from_config(ROOT / "stage_configs/ar_to_dit_shm.yaml", model="kvbridge://tiny-llama")
    with pytest.raises(ValueError, match="n=2"):
        pipe.generate(["A cute cat"], {"n": 2})
    with pytest.raises(ValueError, match="n=2"):
        pipe.submit("A cute cat", {"n": 2})
    assert pipe.stage_pids() == {}
    assert pipe.log_dir is None  # a run never started makes no log directory
