"""``vllm-kvbridge bench speech`` end to end: a real server on the shipped streaming speech
config, real SSE clients, the stages alone in process; the output's structure and its
figures' consistency with the requests it lists, never timings.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_kvbridge.bench.handoff import percentile
from vllm_kvbridge.bench.speech import CONFIG, shipped_config
from vllm_kvbridge.bench.speech_alone import sequential_config
from vllm_kvbridge.cli.main import main

FIGURES = ("first_packet_s", "rtf", "aggregate_rtf")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "0"], "--concurrency wants comma-separated integers >= 1"),
        (["--concurrency", "one"], "--concurrency wants comma-separated integers >= 1"),
        (["--repeats", "0"], "need --requests >= 1, --repeats >= 1"),
        (["--max-tokens", "0"], "need --requests >= 1, --repeats >= 1 and --max-tokens >= 1"),
    ],
)
def test_bad_arguments_are_a_usage_error_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "speech", *argv])
    assert str(exc.value).startswith("vllm-kvbridge bench speech: ") and message in str(exc.value)


def test_the_stages_alone_config_is_the_shipped_one_with_full_edges(tmp_path):
    """The ceiling's pipeline: same stages and models, every payload edge ``full`` and the
    talker stopped after one chunk; a config that is not thinker -> talker -> vocoder is refused."""
    path, thinker_chunk, chunk = sequential_config(shipped_config(), tmp_path)
    shipped = yaml.safe_load(shipped_config().read_text())
    alone = yaml.safe_load(path.read_text())
    assert thinker_chunk == shipped["stages"][0]["payload"]["chunk_size"]
    assert chunk == shipped["stages"][1]["payload"]["chunk_size"]
    for a, s in zip(alone["stages"], shipped["stages"], strict=True):
        assert a["payload"]["mode"] == "full" and s["payload"]["mode"] == "async_chunk"
        assert {k: v for k, v in a.items() if k not in ("payload", "default_sampling_params")} == {
            k: v for k, v in s.items() if k not in ("payload", "default_sampling_params")
        }
    assert alone["stages"][1]["default_sampling_params"]["max_tokens"] == chunk
    assert alone["edges"] == shipped["edges"]
    with pytest.raises(ValueError, match="thinker -> talker -> vocoder"):
        sequential_config(Path(__file__).parents[1] / "stage_configs/ar_to_dit_shm.yaml", tmp_path)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.long(
    900,
    "speech pipelines (two LLM engines each): the stages-alone ceiling, then the served run",
)
def test_bench_speech_end_to_end_figures_match_the_requests(tmp_path):
    out = tmp_path / "speech.json"
    argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "bench", "speech"]
    argv += ["--concurrency", "1,2", "--requests", "2", "--repeats", "1", "--json", str(out)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    shipped = yaml.safe_load(shipped_config().read_text())
    talker_codes = shipped["stages"][1]["default_sampling_params"]["max_tokens"]
    assert data["config"] == CONFIG and data["repeats"] == 1 and data["server_exit"] == 0
    assert data["chunk_size"] == shipped["stages"][1]["payload"]["chunk_size"]
    rate, hop = data["sample_rate"], data["hop_length"]
    table = [line.split() for line in proc.stdout.splitlines()]
    assert [lv["concurrency"] for lv in data["levels"]] == [1, 2]
    for lv in data["levels"]:
        c = lv["concurrency"]
        [load] = data["loads"][str(c)]
        reqs = load["requests"]
        assert len(reqs) == lv["requests"] == 2
        for r in reqs:
            # the first audio came before the end; every code became hop samples, all received
            assert 0 < r["first_packet_s"] <= r["total_s"]
            assert r["codes"] == talker_codes and r["samples"] == r["codes"] * hop
            assert r["audio_s"] == pytest.approx(r["samples"] / rate)
        # the stages alone, one row per request of the ceiling's batch of c
        [alone] = data["stages_alone"][str(c)]
        assert len(alone) == c
        for a in alone:
            assert all(math.isfinite(v) and v > 0 for v in a.values()), a
        for key in FIGURES:
            f = lv[key]
            assert f["value"] > 0 and f["ceiling"] > 0
            assert f["ratio"] == pytest.approx(f["value"] / f["ceiling"])
            assert f["ratio_min"] <= f["ratio_max"]  # one repeat: both the repeat's ratio
            s = f["spread"]
            assert s["min"] <= s["p50"] <= s["p99"] <= s["max"]
        fp = [r["first_packet_s"] for r in reqs]
        assert lv["first_packet_s"]["value"] == pytest.approx(percentile(fp, 0.5))
        assert lv["first_packet_s"]["spread"]["max"] == pytest.approx(max(fp))
        ceiling = [a["thinker_chunk_s"] + a["talker_chunk_s"] + a["vocoder_first_s"] for a in alone]
        assert lv["first_packet_s"]["ceiling"] == pytest.approx(percentile(ceiling, 0.5))
        rtf = [r["audio_s"] / r["total_s"] for r in reqs]
        assert lv["rtf"]["value"] == pytest.approx(percentile(rtf, 0.5))
        aggregate = sum(r["audio_s"] for r in reqs) / load["wall_s"]
        assert lv["aggregate_rtf"]["value"] == pytest.approx(aggregate)
        assert lv["aggregate_rtf"]["ceiling"] == pytest.approx(c * lv["rtf"]["ceiling"])
        # the printed table shows the same figures: value, ceiling, ratio of each
        for key, name in (("first_packet_s", "first packet (s)"), ("rtf", "RTF per request")):
            f = lv[key]
            [row] = [r for r in table if r[: len(name.split()) + 1] == [str(c), *name.split()]]
            shown = row[len(name.split()) + 1 :][:3]
            assert shown == [f"{f['value']:.3f}", f"{f['ceiling']:.3f}", f"{f['ratio']:.2f}x"], row
