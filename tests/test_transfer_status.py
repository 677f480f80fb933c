"""The status lines of kvbridge_transfer_status (runner/transfer_status.py): one bounded
history for the KV sender and the payload runtime, and the merge of their two lines."""

from __future__ import annotations

from vllm_kvbridge.runner.transfer_status import StatusHistory, merge_status


def test_the_history_keeps_the_newest_lines_and_hands_out_copies() -> None:
    history = StatusHistory(limit=3)
    for i in range(5):
        history.record(f"r{i}", {"kv": "done", "aborted": "false"})
    assert list(history) == ["r2", "r3", "r4"] and "r1" not in history
    history.record("r2", {"kv": "failed: x", "aborted": "false"})  # re-recorded: newest again
    history.record("r5", {"kv": "done", "aborted": "false"})
    assert list(history) == ["r4", "r2", "r5"]
    line = history.get("r2")
    line["kv"] = "changed"  # a copy: the kept line is untouched
    assert history.get("r2") == {"kv": "failed: x", "aborted": "false"}
    history.mark("r2", "aborted", "true")
    history.mark("gone", "aborted", "true")  # not kept: nothing to mark
    assert history.get("r2")["aborted"] == "true" and history.get("gone") is None


def test_merge_reads_unknown_for_a_side_that_never_heard_of_the_request() -> None:
    assert merge_status({"kv": "done", "aborted": "false"}, None) == {
        "kv": "done",
        "payload": "unknown",
        "aborted": "false",
    }
    assert merge_status({"kv": "pending", "aborted": "false"}, {"payload": "done", "aborted": "true"}) == {
        "kv": "pending",
        "payload": "done",
        "aborted": "true",
    }
