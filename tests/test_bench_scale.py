"""``vllm-kvbridge bench scale`` (issue 41) and its stand-in DiT.

End to end: real pipelines (a vLLM engine and 1 or 4 DiT replica processes), the output's
structure, its figures' consistency with the requests it lists, and that each replica
count was served by that many replicas (from the requests' result records); never
timings. The stand-in DiT: refused unless the bench's variable is set, never named by a
shipped config, the same images as the tiny DiT, and the wait it adds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from vllm_kvbridge.bench.handoff import percentile
from vllm_kvbridge.bench.scale import CONFIG, scaled_config, stand_in_label, windows
from vllm_kvbridge.cli.main import main
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.models.fixed_time_dit import CLASS_PATH, ENV, FixedTimeDiT
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
from vllm_kvbridge.runner.diffusion_batch import BatchRow, batch_forward_of, denoise_batch
from vllm_kvbridge.runner.diffusion_runner import build_module

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / CONFIG


def _kv(seed: int, seq: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(seq, 2, 32, generator=g), torch.randn(seq, 2, 32, generator=g)) for _ in range(2)]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--replicas", "0,2"], "--replicas wants comma-separated integers >= 1"),
        (["--replicas", "two"], "--replicas wants comma-separated integers >= 1"),
        (["--modes", "gpu"], "--modes: choose from compute, stand-in"),
        (["--requests", "4"], "--requests >= --concurrency"),
        (["--repeats", "0"], "--repeats >= 1"),
        (["--step-ms", "0"], "--step-ms must be > 0"),
        (["--stage-config", "nowhere.yaml"], "--stage-config: no such file 'nowhere.yaml'"),
        (["--stage-config", "stage_configs/thinker_talker_vocoder.yaml"], "exactly one diffusion stage"),
    ],
)
def test_bad_arguments_are_a_usage_error_before_anything_starts(argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "scale", *argv])
    assert str(exc.value).startswith("vllm-kvbridge bench scale: ") and message in str(exc.value)


def test_the_scaled_config_is_the_shipped_one_with_replicas_and_the_stand_in(tmp_path):
    shipped = yaml.safe_load(SHIPPED.read_text())
    plain = yaml.safe_load(scaled_config(SHIPPED, 4, None, tmp_path).read_text())
    stand_in = yaml.safe_load(scaled_config(SHIPPED, 2, 0.05, tmp_path).read_text())
    assert plain["stages"][1]["replicas"] == 4 and stand_in["stages"][1]["replicas"] == 2
    # compute: nothing else changed; stand-in: the module, and step_s beside its kwargs
    plain["stages"][1].pop("replicas")
    assert plain == shipped
    d = stand_in["stages"][1]["diffusion"]
    assert d["class_path"] == CLASS_PATH
    assert d["kwargs"] == {**shipped["stages"][1]["diffusion"]["kwargs"], "step_s": 0.05}
    assert d["max_batch_size"] == shipped["stages"][1]["diffusion"]["max_batch_size"]
    assert stand_in["stages"][0] == shipped["stages"][0] and stand_in["edges"] == shipped["edges"]
    speech = ROOT / "stage_configs/thinker_talker_vocoder.yaml"
    with pytest.raises(ValueError, match="exactly one diffusion stage, found 0"):
        scaled_config(speech, 2, None, tmp_path)


def test_the_timed_windows_skip_the_ramp_and_start_at_the_completion_before_them():
    done = [(float(t), f"r{i}") for i, t in enumerate([1, 2, 4, 5, 7, 8, 12, 13, 20])]
    got = windows(done, skip=2, n=3, repeats=2)
    assert [w["requests"] for w in got] == [["r2", "r3", "r4"], ["r5", "r6", "r7"]]
    assert [w["wall_s"] for w in got] == [7 - 2, 13 - 7]  # the tail (r8) is not timed


def test_the_stand_in_dit_builds_only_for_the_bench(monkeypatch):
    """A config naming it fails where the stage builds its module, saying why, unless the
    bench's variable is set (only bench scale sets it, for its own stage processes)."""
    monkeypatch.delenv(ENV, raising=False)
    kwargs = {"image_size": 32, "patch_size": 4, "hidden": 64, "depth": 2, "seed": 0, "step_s": 0.01}
    with pytest.raises(ConfigError, match=f"{ENV}=1") as exc:
        build_module(CLASS_PATH, kwargs)
    assert "stand-in for GPU time" in str(exc.value) and "TinyKVDiT" in str(exc.value)
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(ConfigError, match=f"{ENV}=1"):
        build_module(CLASS_PATH, kwargs)
    monkeypatch.setenv(ENV, "1")
    assert isinstance(build_module(CLASS_PATH, kwargs), FixedTimeDiT)
    with pytest.raises(ConfigError, match="step_s must be > 0"):
        build_module(CLASS_PATH, {**kwargs, "step_s": 0})


def test_no_shipped_config_or_example_names_the_stand_in():
    files = [*ROOT.glob("stage_configs/*.yaml"), *ROOT.glob("examples/**/*.py")]
    assert len(files) > 10
    for path in files:
        text = path.read_text()
        assert "fixed_time_dit" not in text and "FixedTimeDiT" not in text and ENV not in text, path


def test_the_stand_in_paints_the_tiny_dits_images_and_waits_per_row_and_step(monkeypatch):
    """Same weights and compute as TinyKVDiT (bit-exact images, batched and not), plus
    ``step_s`` per row of every forward: a batch of B waits B x as long (compute-bound)."""
    monkeypatch.setenv(ENV, "1")
    kwargs = {"image_size": 16, "seed": 0}
    tiny, slow = TinyKVDiT(**kwargs).eval(), FixedTimeDiT(step_s=0.002, **kwargs).eval()
    assert batch_forward_of(slow) == slow.forward_batch  # batched, through its own override
    rows = [BatchRow(f"r{i}", _kv(i), seed=i) for i in range(3)]
    start = time.perf_counter()
    got = denoise_batch(slow, rows, num_steps=4)
    elapsed = time.perf_counter() - start
    want = denoise_batch(tiny, rows, num_steps=4)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert slow.waited_s == pytest.approx(4 * 3 * 0.002)
    assert elapsed >= slow.waited_s  # a sleep lasts at least what it was asked
    alone = denoise_batch(slow, rows[:1], num_steps=4)  # one row through the batched path
    assert torch.equal(alone[0], denoise_batch(tiny, rows[:1], num_steps=4)[0])
    assert slow.waited_s == pytest.approx(4 * 4 * 0.002)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.long(
    900, "the AR -> DiT pipeline started twice (1 and 4 DiT replicas) and a timed closed loop over each"
)
def test_bench_scale_end_to_end_each_count_served_by_that_many_replicas(tmp_path):
    """1 and 4 DiT replicas with the stand-in DiT (30 ms per step and request: 8 steps keep
    each request in a replica for 0.24 s and more, while the warm-up's 8 requests leave the
    LLM stage in the same engine steps, so the DiT holds them all at once and
    least-outstanding routing spreads them over every replica)."""
    out = tmp_path / "scale.json"
    argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "bench", "scale", "--replicas", "1,4"]
    argv += ["--modes", "stand-in", "--step-ms", "30", "--requests", "8", "--repeats", "1"]
    argv += ["--baseline", "1", "--json", str(out)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop(ENV, None)  # the bench hands it to its own stages
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["replicas"] == [1, 4] and data["concurrency"] == 8 and data["repeats"] == 1
    assert list(data["modes"]) == ["stand-in"]
    mode = data["modes"]["stand-in"]
    assert mode["label"] == stand_in_label(30) and mode["step_ms"] == 30
    assert "STAND-IN for GPU time" in mode["label"]
    alone = mode["dit_alone"]
    assert alone["batch"] == 8 and alone["single_per_s"] > 0 and alone["batched_per_s"] > 0
    alone_per_s = max(alone["single_per_s"], alone["batched_per_s"])
    rows = {row["replicas"]: row for row in mode["rows"]}
    assert list(rows) == [1, 4]
    thr = {}
    for n, row in rows.items():
        [load] = mode["loads"][str(n)]
        reqs = load["requests"]
        assert len(reqs) == row["requests"] == 8 and row["failed"] == 0 and row["errors"] == []
        assert all(r["error"] is None and r["latency_s"] > 0 for r in reqs)
        # served by exactly n replicas, as the requests' result records say: over the whole
        # run (its first 8 reach the DiT together and spread over every replica); a window
        # of 8 may miss one that was busy with a batch of several
        assert list(row["served_by"]) == [str(k) for k in range(n)], row["served_by"]
        assert sum(row["served_by"].values()) == 8 + 1 + 8 + 8 + 8  # warm-up, unloaded, ramp, window, tail
        served = [r["replica"] for r in reqs]
        assert set(served) <= set(range(n)), served
        assert row["requests_per_replica"] == {str(k): served.count(k) for k in sorted(set(served))}
        assert all(r["ar_s"] > 0 and r["dit_s"] > 0 for r in reqs)
        assert row["dit_p50_s"] == pytest.approx(percentile([r["dit_s"] for r in reqs], 0.5))
        thr[n] = 8 / load["wall_s"]
        t = row["throughput"]
        assert t["value"] == pytest.approx(thr[n]) and t["min"] == t["max"] == t["value"]
        lat = [r["latency_s"] for r in reqs]
        assert row["latency"]["p50"] == pytest.approx(percentile(lat, 0.5))
        assert row["latency"]["max"] == pytest.approx(max(lat))
        [unloaded] = mode["unloaded_s"][str(n)]
        assert row["unloaded_s"] == pytest.approx(unloaded)
        assert row["p99_x_unloaded"] == pytest.approx(percentile(lat, 0.99) / unloaded)
        assert row["dit_alone_ceiling"] == pytest.approx(n * alone_per_s)
        assert row["of_dit_alone"] == pytest.approx(thr[n] / (n * alone_per_s))
    for n, row in rows.items():
        assert row["speedup"]["value"] == pytest.approx(thr[n] / thr[1])
        assert row["linear_ceiling"] == pytest.approx(n * thr[1])
        assert row["of_linear"]["value"] == pytest.approx(thr[n] / (n * thr[1]))
    # the printed table: the label, then one line per count with the same figures
    lines = proc.stdout.splitlines()
    assert any(line.startswith("mode stand-in: STAND-IN for GPU time") for line in lines)
    for n, row in rows.items():
        [line] = [x for x in lines if x.split()[:1] == [str(n)] and "x" in x]
        cells = line.split()
        assert (
            cells[1] == f"{row['throughput']['value']:.2f}" and cells[3] == f"{row['speedup']['value']:.2f}x"
        )
        assert cells[13] == str(row["failed"])
        assert cells[14:] == [f"{k}:{v}" for k, v in row["requests_per_replica"].items()]
    print(proc.stdout)
