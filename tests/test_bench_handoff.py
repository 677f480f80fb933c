"""Smoke test of ``vllm-kvbridge bench handoff`` (shape of the output, never timings)."""

from __future__ import annotations

import json
import math

import pytest

from vllm_kvbridge.bench.handoff import PATHS, percentile, stage_payload
from vllm_kvbridge.bench.handoff_pipeline import collect
from vllm_kvbridge.cli.main import main
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.results import RequestResult, StageRecord

pytestmark = pytest.mark.forked

FIELDS = {"connector", "bytes", "p50_ms", "p99_ms", "path", "ceiling_p50_ms", "ceiling_p99_ms", "ratio"}


def test_bench_handoff_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["bench", "handoff", "--connectors", "shm,zmq", "--sizes", "1KB,64KB", "--repeat", "5"]
    assert main([*args, "--idle-ms", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["connector", "path", "bytes"] and "ceil" in table[0]
    expected = [(c, p, b) for b in (1024, 65536) for c in ("shm", "zmq") for p in PATHS]
    assert [tuple(line.split()[:3]) for line in table[2:]] == [(c, p, str(b)) for c, p, b in expected]
    rows = json.loads(out.read_text())
    assert [(r["connector"], r["path"], r["bytes"]) for r in rows] == expected
    for row in rows:
        assert row.keys() >= FIELDS and row["repeat"] == 5
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in FIELDS - {"connector", "path"})
        assert row["p99_ms"] >= row["p50_ms"] and row["ceiling_p99_ms"] >= row["ceiling_p50_ms"]
        # the ratio is to the ceiling measured in the same run, for the same connector and size
        assert math.isclose(row["ratio"], row["p50_ms"] / row["ceiling_p50_ms"], rel_tol=1e-9)
    for c in ("shm", "zmq"):
        for b in (1024, 65536):
            same = [r["ceiling_p50_ms"] for r in rows if (r["connector"], r["bytes"]) == (c, b)]
            assert len(set(same)) == 1  # one ceiling per connector and size, shared by its paths


def test_arguments_are_validated():
    for bad in (["--sizes", "lots"], ["--repeat", "0"], ["--paths", "teleport"], ["--idle-ms", "-1"]):
        with pytest.raises(SystemExit):
            main(["bench", "handoff", *bad])


def test_payload_is_the_stage_envelope_and_percentiles_are_nearest_rank():
    env = stage_payload(64 << 10, "r")
    assert env["kvbridge"]["kind"] == "full" and env["kvbridge"]["rid"] == "r"
    rows = env["data"]["hidden_states"]
    assert rows.numel() * rows.element_size() == 64 << 10
    values = [float(i) for i in range(1, 101)]
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99 and percentile(values, 1.0) == 100
    assert percentile([3.0], 0.99) == 3.0 and math.isnan(percentile([], 0.5))


def _result(last: float, ready: float, first: float) -> RequestResult:
    r = RequestResult("r", "p")
    r.stages = [
        StageRecord(0, "llm_ar", 0.0, first_token_at=last - 1, last_token_at=last),
        StageRecord(1, "llm_generation", 0.0, first_token_at=first, last_token_at=first + 1),
    ]
    r.transfers = [m.TransferStat(0, 1, "payload", 6656, 0.001, "receiver", waited_s=0.2, ready_at=ready)]
    return r


def test_pipeline_rows_come_from_the_stages_timestamps():
    """What --pipeline measures, on results as the pipeline returns them (no engines here)."""
    got = collect([_result(100.0, 100.010, 100.050), _result(200.0, 200.020, 200.070)])
    ((edge, (nbytes, ready, first)),) = got.items()
    assert edge == (0, 1) and nbytes == 6656
    assert [round(x, 6) for x in ready] == [0.01, 0.02] and [round(x, 6) for x in first] == [0.05, 0.07]
    unmeasured = _result(300.0, 0.0, 300.1)  # no ready_at (a KV edge, a per-step feed): left out
    assert collect([unmeasured]) == {}
