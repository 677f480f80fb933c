"""Smoke test of ``vllm-kvbridge bench connectors`` (shape of the output, never timings)."""

from __future__ import annotations

import json
import math

import pytest

from vllm_kvbridge.bench.connectors import kv_payload, parse_size, payload_bytes
from vllm_kvbridge.cli.main import main

pytest_plugins = ["connector_fixtures"]
# slow: real bench rows over every connector, ~35 s in all
pytestmark = [pytest.mark.forked, pytest.mark.slow]

KEYS = {"connector", "bytes", "e2e_s", "gbps", "memcpy_gbps", "ratio", "ceiling_gbps", "ceiling_ratio"}


def test_bench_connectors_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert (
        main(
            [
                "bench",
                "connectors",
                "--connectors",
                "shm,zmq",
                "--sizes",
                "64KB,256KB",
                "--repeat",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["connector", "bytes"] and "ceiling" in table[0]
    assert [line.split()[0] for line in table[2:]] == ["shm", "zmq", "shm", "zmq"]
    rows = json.loads(out.read_text())
    assert [r["connector"] for r in rows] == ["shm", "zmq", "shm", "zmq"]
    for row in rows:
        assert row.keys() >= KEYS
        assert row["bytes"] > 0 and all(math.isfinite(row[k]) and row[k] > 0 for k in KEYS - {"connector"})


def test_sizes_and_arguments_are_validated():
    assert parse_size("64KB") == 64 << 10 and parse_size("1.5MB") == 3 << 19 and parse_size("2GB") == 2 << 30
    for bad in ("", "xMB", "-1MB", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(SystemExit):
        main(["bench", "connectors", "--sizes", "lots"])
    with pytest.raises(SystemExit):
        main(["bench", "connectors", "--repeat", "0"])
    assert abs(payload_bytes(kv_payload(64 << 20)) - (64 << 20)) < (64 << 20) // 50


@pytest.mark.parametrize("connector", ["mooncake", "mooncake-te", "nixl"])
def test_bench_row_has_an_interleaved_raw_engine_ceiling(connector, tmp_path, capsys, request, monkeypatch):
    """The Mooncake store against its own put + get, mooncake-te against a raw
    transfer-engine write + read, nixl against NIXL's own agent write + READ: each sampled
    between the connector's transfers, with its spread; the two engines that read the
    sender's memory also give their get against the read alone."""
    if connector == "mooncake":  # the bench finds this test's master through the environment
        master = request.getfixturevalue("mooncake_master")
        for name, value in master.env().items():
            monkeypatch.setenv(name, value)
    out = tmp_path / "rows.json"
    args = ["bench", "connectors", "--connectors", connector, "--sizes", "256KB", "--repeat", "3"]
    assert main([*args, "--json", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[0] == connector
    (row,) = json.loads(out.read_text())
    spread = {"gbps_min", "gbps_max", "ceiling_min_gbps", "ceiling_max_gbps"}
    assert row.keys() >= KEYS | spread
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in (KEYS | spread) - {"connector"})
    assert row["gbps_min"] <= row["gbps"] <= row["gbps_max"]
    assert row["ceiling_min_gbps"] <= row["ceiling_gbps"] <= row["ceiling_max_gbps"]
    assert math.isfinite(row["get_ratio"]) == (connector != "mooncake"), row
    if connector != "mooncake":
        assert row["get_ratio"] > 0
