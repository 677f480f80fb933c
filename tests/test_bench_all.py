"""``vllm-kvbridge bench all`` end to end (real benches, shape of the output, never timings).

Only the connectors and handoff groups: kv-path and serve start vLLM engines (minutes).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from vllm_kvbridge.bench.all import parse_only, size_label
from vllm_kvbridge.cli.main import main

#: Smaller than the figures' 64 MB: the test checks the mechanism, in a fraction of the time.
SIZE = 8 << 20
CONNECTOR_FIGURES = {
    f"{what}, {size_label(SIZE)}"
    for what in (
        "Mooncake store vs Mooncake's own put/get",
        "NIXL connector vs NIXL agent write+READ",
        "NIXL get vs NIXL READ",
        "Mooncake TE vs raw TE write+read",
        "Mooncake TE get vs raw TE read",
        "SHM vs memcpy",
        "ZMQ vs bare pyzmq",
    )
}
HANDOFF_FIGURES = {"1 KB handoff p50, SHM (stage path)", "1 KB handoff p50, SHM (Connector.get)"}


@pytest.mark.slow
@pytest.mark.long(
    600,
    "two real bench groups (connectors over five transports, handoff), each figure repeated",
)
def test_bench_all_prints_one_table_and_writes_json(tmp_path):
    out = tmp_path / "all.json"
    argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "bench", "all"]
    argv += ["--only", "connectors,handoff", "--repeat", "2", "--size", "8MB", "--json", str(out)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    figures = {f["figure"]: f for f in data["figures"]}
    assert set(figures) == CONNECTOR_FIGURES | HANDOFF_FIGURES
    assert {f["group"] for f in data["figures"]} == {"connectors", "handoff"}
    assert set(data["seconds"]) == {"connectors", "handoff"} and data["repeat"] == 2
    for f in data["figures"]:
        assert f["goal"] and f["met"] in (True, False, None)
        if f["value"] is None:  # an engine that cannot run here: said why, in one line
            assert f["reason"] and "\n" not in f["reason"] and f["met"] is None
        else:
            assert math.isfinite(f["value"]) and f["value"] > 0 and f["ceiling"] and not f["reason"]
            met = f["value"] >= f["goal_value"] if f["goal_op"] == ">=" else f["value"] <= f["goal_value"]
            assert f["met"] == met
    # shm and zmq need nothing optional: they always run, with a spread over the repeats
    for name in (f"SHM vs memcpy, {size_label(SIZE)}", f"ZMQ vs bare pyzmq, {size_label(SIZE)}"):
        f = figures[name]
        assert f["value"] is not None
        assert f["spread_min"] * (1 - 1e-9) <= f["value"] <= f["spread_max"] * (1 + 1e-9)
    for name in HANDOFF_FIGURES:
        assert figures[name]["value"] is not None and figures[name]["goal"] == "<= 1 ms"
    # each bench's own result rides along
    assert {r["connector"] for r in data["benches"]["connectors"]} >= {"shm", "zmq"}
    assert {r["path"] for r in data["benches"]["handoff"]} == {"get", "stage"}
    # one table, on stdout: the header, then a line per figure
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("bench all:"))
    assert lines[start + 1].split()[:3] == ["figure", "value", "goal"]
    table = lines[start + 3 : start + 3 + len(figures)]
    assert [line[: len(f["figure"])] for line, f in zip(table, data["figures"])] == [
        f["figure"] for f in data["figures"]
    ]
    print(proc.stdout)


def test_arguments():
    assert parse_only("handoff,connectors") == ["connectors", "handoff"]
    assert parse_only("scale,serve") == ["serve", "scale"]  # bench scale's group (issue 41)
    for bad in ("", "teleport", "connectors,gpu"):
        with pytest.raises(ValueError):
            parse_only(bad)
    assert size_label(64 << 20) == "64 MB" and size_label(1024) == "1 KB" and size_label(100) == "100 B"
    for bad in (["--only", "teleport"], ["--repeat", "0"], ["--size", "lots"]):
        with pytest.raises(SystemExit, match="bench all"):  # before anything runs
            main(["bench", "all", *bad])
