"""The sender info an LLM stage reports: every rank's keys, ranks and the KV head count."""

from __future__ import annotations

from vllm_kvbridge.pipeline.sender_info import merge_kv_info


def test_ranks_are_merged_and_head_count_is_forwarded() -> None:
    per_rank = [
        {"kv": {"r1": {"keys": {"0": "k0"}, "ranks": {"0": {"ns": "a"}}, "num_kv_heads": 8}}},
        {"kv": {"r1": {"keys": {"1": "k1"}, "ranks": {"1": {"ns": "a"}}, "num_kv_heads": 8}}},
        {"kv": {"other": {"keys": {"0": "x"}}}},
    ]
    assert merge_kv_info(per_rank, "r1") == {
        "keys": {"0": "k0", "1": "k1"},
        "ranks": {"0": {"ns": "a"}, "1": {"ns": "a"}},
        "num_kv_heads": 8,
    }


def test_unknown_request_gives_empty_info() -> None:
    assert merge_kv_info([{"kv": {}}, {}], "missing") == {}
