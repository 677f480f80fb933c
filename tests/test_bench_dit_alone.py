"""The DiT-alone ceiling of ``bench all``'s serve figure (bench/dit_alone.py): the shipped
image config's module, batched as its stage batches, on synthetic KV of the tiny LLM's shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvbridge.bench.dit_alone import describe, measure_dit_alone

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_image_config_is_measured_at_batch_1_and_its_max_batch() -> None:
    r = measure_dit_alone(ROOT / "stage_configs/ar_to_dit_shm.yaml", repeat=2)
    assert r.batch == 8  # the config's max_batch_size
    for rate, (lo, hi) in ((r.single_per_s, r.single_min_max), (r.batched_per_s, r.batched_min_max)):
        assert 0 < lo <= rate <= hi
    assert describe(r)["speedup"] == pytest.approx(r.batched_per_s / r.single_per_s)


def test_a_config_without_a_diffusion_stage_is_refused() -> None:
    with pytest.raises(ValueError, match="no diffusion stage"):
        measure_dit_alone(ROOT / "stage_configs/thinker_talker_full_payload.yaml", repeat=1)
