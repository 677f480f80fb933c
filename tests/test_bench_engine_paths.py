"""``vllm-kvbridge bench ar-overhead`` and ``bench kv-path`` end to end, reduced (2-layer KV-heavy
model, short prompts, 2 repeats): what they print and write, never how fast anything was.

Each bench runs once per module (through the CLI, with ``--json``) and the tests read that
run. The helpers at the bottom need no engine.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import time
from typing import Any

import pytest

from vllm_kvbridge.bench.ar_overhead import KVBRIDGE, PLAIN, max_tokens_of, summarize
from vllm_kvbridge.bench.kv_model import kv_bytes
from vllm_kvbridge.bench.kv_path import Unavailable, edge_configs, parse_connectors, parse_tokens
from vllm_kvbridge.cli.main import main

LAYERS = 2
KV_PATH_TOKENS = (96, 300)
REPEAT = 2
AR = {"requests": 4, "prompt_len": 16, "max_tokens": 8}


def _cli(argv: list[str]) -> str:
    before = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    # A bench run in-process sizes its engines' KV cache by argument: a VLLM_CPU_KVCACHE_SPACE
    # left behind would size the KV cache of every engine this process starts later.
    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == before
    return out.getvalue()


@pytest.fixture(scope="module")
def kv_path(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("kv-path")
    argv = ["bench", "kv-path", "--connectors", "shm,zmq", "--layers", str(LAYERS), "--repeat", str(REPEAT)]
    argv += ["--tokens", ",".join(map(str, KV_PATH_TOKENS)), "--cache-dir", str(tmp), "--settle-s", "0"]
    printed = _cli([*argv, "--json", str(tmp / "rows.json")])
    return printed, json.loads((tmp / "rows.json").read_text())


@pytest.fixture(scope="module")
def ar_overhead(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ar-overhead")
    argv = ["bench", "ar-overhead", "--layers", str(LAYERS), "--repeat", str(REPEAT), "--settle-s", "0"]
    argv += ["--requests", str(AR["requests"]), "--prompt-len", str(AR["prompt_len"])]
    argv += ["--max-tokens", str(AR["max_tokens"]), "--cache-dir", str(tmp)]
    printed = _cli([*argv, "--json", str(tmp / "result.json")])
    return printed, json.loads((tmp / "result.json").read_text())


@pytest.mark.engine
@pytest.mark.long(300, "the bench's vLLM engines (module fixtures) start in the first test that uses them")
@pytest.mark.slow
def test_kv_path_rows_are_per_connector_and_token_count(kv_path) -> None:
    _, rows = kv_path
    expected = [(c, t) for c in ("shm", "zmq") for t in KV_PATH_TOKENS]
    assert [(r["connector"], r["tokens"]) for r in rows] == expected
    for row in rows:
        assert row.keys() >= {"connector", "tokens", "bytes", "seconds", "gbps", "ratio", "memcpy_gbps"}
        # The KV of the whole prompt (max_tokens=1: the sampled token has no KV yet):
        # 2 (K, V) x layers x 4 KV heads x head_dim 128 x tokens x 4 bytes (float32).
        assert (
            row["bytes"]
            == kv_bytes(row["tokens"], LAYERS, "float32")
            == 2 * LAYERS * 4 * 128 * row["tokens"] * 4
        )
        assert row["repeats"] == REPEAT
        assert row["seconds_min"] <= row["seconds"] <= row["seconds_max"]
        assert math.isclose(row["gbps"], row["bytes"] / row["seconds"] / 1e9, rel_tol=1e-9)
        # ratio is to the memcpy of the same run and the same bytes
        assert math.isclose(row["ratio"], row["gbps"] / row["memcpy_gbps"], rel_tol=1e-9)
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("seconds", "gbps", "ratio", "memcpy_gbps"))
        # and to the layout's own gather of the same KV, sampled with it
        assert math.isclose(row["gather_ratio"], row["gbps"] / row["gather_gbps"], rel_tol=1e-9)
        assert math.isfinite(row["gather_gbps"]) and row["gather_gbps"] > 0
        # and to the connector's bare transport moving the same bytes, in the same run
        assert math.isclose(row["transport_ratio"], row["gbps"] / row["transport_gbps"], rel_tol=1e-9)
        assert math.isfinite(row["transport_gbps"]) and row["transport_gbps"] > 0
        # the sender's own put time comes from its connector's counters (worker RPC)
        assert math.isfinite(row["put_s"]) and row["put_s"] >= 0, row


@pytest.mark.engine
@pytest.mark.long(300, "the bench's vLLM engines (module fixtures) start in the first test that uses them")
@pytest.mark.slow
def test_kv_path_prints_a_table(kv_path) -> None:
    printed, rows = kv_path
    lines = printed.splitlines()  # vLLM logs to stdout too: the table is at the end
    title = max(i for i, line in enumerate(lines) if line.startswith("kv-path:"))
    header = lines[title + 1]
    assert header.split()[:2] == ["connector", "tokens"] and "memcpy" in header and "ratio" in header
    assert "x gather" in header and "x transp" in header
    body = lines[title + 3 :]
    assert [(line.split()[0], int(line.split()[1])) for line in body] == [
        (r["connector"], r["tokens"]) for r in rows
    ]
    assert "skipped" not in printed and "FAILED" not in printed
    assert [n for n in os.listdir("/dev/shm") if f"kvpath{os.getpid()}" in n] == []  # nothing left


@pytest.mark.engine
@pytest.mark.long(300, "the bench's vLLM engines (module fixtures) start in the first test that uses them")
@pytest.mark.slow
def test_ar_overhead_interleaves_the_asked_samples(ar_overhead) -> None:
    printed, result = ar_overhead
    samples = result["samples"]
    for side in (PLAIN, KVBRIDGE):
        assert len([s for s in samples if s["side"] == side]) >= REPEAT
    # interleaved, the order flipped every pair: plain, kvbridge, kvbridge, plain, ...
    assert [s["side"] for s in samples] == [PLAIN, KVBRIDGE, KVBRIDGE, PLAIN][: 2 * REPEAT]
    generated = sum(max_tokens_of(i, AR["max_tokens"]) for i in range(AR["requests"]))
    for s in samples:
        assert s["tokens"] == generated  # ignore_eos: every request generates its max_tokens
        assert math.isclose(s["tok_s"], s["tokens"] / s["seconds"], rel_tol=1e-9)
    summary = result["summary"]
    assert len(summary["ratios"]) == REPEAT
    assert summary == json.loads(json.dumps(summarize(samples)))
    # Every kvbridge batch (warm-up included) sent every request's KV and the receiver got it:
    # prompt + generated - 1 tokens each (the last sampled token has no KV).
    per_batch = sum(
        kv_bytes(AR["prompt_len"] + max_tokens_of(i, AR["max_tokens"]) - 1, LAYERS, "float32")
        for i in range(AR["requests"])
    )
    assert result["kv_caches_received"] == AR["requests"] * (REPEAT + 1)
    assert result["kv_bytes_received"] == per_batch * (REPEAT + 1)
    assert "noise floor on this machine:" in printed and "slowdown" in printed
    assert [n for n in os.listdir("/dev/shm") if f"arov{os.getpid()}" in n] == []  # nothing left


# -- no engine ---------------------------------------------------------------------------------
def test_summary_ratios_slowdown_and_noise_floor() -> None:
    samples = [
        {"side": PLAIN, "pair": 0, "tok_s": 100.0},
        {"side": KVBRIDGE, "pair": 0, "tok_s": 90.0},
        {"side": KVBRIDGE, "pair": 1, "tok_s": 99.0},
        {"side": PLAIN, "pair": 1, "tok_s": 110.0},
        {"side": PLAIN, "pair": 2, "tok_s": 105.0},
        {"side": KVBRIDGE, "pair": 2, "tok_s": 84.0},
    ]
    s = summarize(samples)
    assert s["ratios"] == pytest.approx([0.9, 0.9, 0.8])
    assert s["ratio"] == pytest.approx({"min": 0.8, "median": 0.9, "max": 0.9})
    assert s["slowdown"] == pytest.approx(0.1)
    assert s[PLAIN] == {"min": 100.0, "median": 105.0, "max": 110.0}
    assert s["noise_floor"] == pytest.approx(10 / 105)
    assert s["ratio_by_order"] == pytest.approx({"plain_first": 0.85, "kvbridge_first": 0.9})


def test_kv_path_arguments_are_validated() -> None:
    assert parse_tokens("512, 2048,8192") == [512, 2048, 8192]
    assert parse_connectors("shm,zmq,mooncake") == ["shm", "zmq", "mooncake"]
    assert parse_connectors("mooncake-te,nixl") == ["mooncake-te", "nixl"]
    for bad in ("", "x", "0", "512,-1"):
        with pytest.raises(ValueError):
            parse_tokens(bad)
    for bad in ("", "tcp", "shm,ucx"):
        with pytest.raises(ValueError):
            parse_connectors(bad)
    for argv in (["--tokens", "lots"], ["--connectors", "carrier-pigeon"], ["--repeat", "0"]):
        with pytest.raises(SystemExit):
            main(["bench", "kv-path", *argv])


def test_kv_path_skips_mooncake_where_it_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as if not installed
    with pytest.raises(Unavailable, match="Mooncake"):
        edge_configs("mooncake", 1 << 20)
    send, recv = edge_configs("zmq", 1 << 20)
    assert recv["endpoint"] == f"tcp://127.0.0.1:{send['port']}"
    send, recv = edge_configs("shm", 1 << 20)
    assert send == recv


@pytest.mark.parametrize("name", ["mooncake-te", "nixl"])
def test_kv_path_edges_of_the_engine_connectors_move_a_payload(name: str) -> None:
    """The engine path runs on the transfer-engine and NIXL connectors too (issue 37, item 3):
    the configs it gives each side make a working pair (the receiver finds the sender in
    the put's metadata). Their engine runs are in the bench, not here (one engine each)."""
    import torch

    from vllm_kvbridge.bench.kv_path import CONNECTORS
    from vllm_kvbridge.connectors import create_connector

    send, recv = edge_configs(name, 1 << 20)
    payload = {"k": torch.arange(4096, dtype=torch.float32)}
    with (
        create_connector(CONNECTORS[name], send) as sender,
        create_connector(CONNECTORS[name], recv) as receiver,
    ):
        result = sender.put(0, 1, "kv-path-probe", payload)
        assert result.ok, result.error
        got = receiver.get(0, 1, "kv-path-probe", result.metadata, deadline=time.monotonic() + 30)
        assert torch.equal(got["k"], payload["k"])


def test_kv_heavy_model_bytes() -> None:
    # Qwen2.5-7B's KV: 28 layers x 4 heads x 128, float32 = 112 KiB per token; bf16 half that.
    assert kv_bytes(1) == 28 * 2 * 4 * 128 * 4 == 112 << 10
    assert kv_bytes(8192, dtype="bfloat16") == 8192 * (56 << 10)
