"""The status lines of kvbridge_transfer_status (runner/transfer_status.py): one bounded
history for the KV sender and the payload runtime, and the merge of their two lines."""

from __future__ import annotations

from vllm_kvbridge.runner.transfer_status import (
    StatusHistory,
    TransferStatus,
    failed,
    is_failed,
    merge_status,
    parse_status,
)


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


def test_a_status_value_parses_into_the_enum_and_its_reason() -> None:
    assert parse_status("done") == (TransferStatus.DONE, "")
    assert parse_status(failed("put timed out: edge full")) == (
        TransferStatus.FAILED,
        "put timed out: edge full",
    )
    assert is_failed(failed("x")) and not is_failed("pending") and not is_failed(TransferStatus.ABORTED)
    # A value no side writes is not taken for any status, failure included.
    assert parse_status("failedish") == (TransferStatus.UNKNOWN, "failedish")
    assert not is_failed("failedish")
