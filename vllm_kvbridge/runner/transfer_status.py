"""The status lines a stage's workers answer ``kvbridge_transfer_status`` with, and the one
bounded history both halves keep them in after a request is gone.

Two halves report on a request: the KV sender (:class:`~vllm_kvbridge.runner.kv_sender.WorkerKVSender`,
``{"kv": ..., "aborted": ...}``) and the runner's payload flows
(:class:`~vllm_kvbridge.runner.runtime.RequestState`, ``{"payload": ..., "aborted": ...}``);
:func:`merge_status` makes one line of the two. Each keeps the terminal lines of requests
that ended in a :class:`StatusHistory`, so the orchestrator may ask after the fact, and
only the newest :data:`STATUS_HISTORY` of them (the history never grows with the number
of requests).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from enum import StrEnum

#: Terminal statuses kept for status queries after a request ended.
STATUS_HISTORY = 4096


class TransferStatus(StrEnum):
    """Where one transfer (a request's KV or its payloads) stands. A failure carries its
    reason on the wire as ``"failed: <reason>"`` (:func:`failed`, :func:`parse_status`)."""

    NONE = "none"  # nothing to move for this request
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"
    UNKNOWN = "unknown"  # this side never heard of the request (or forgot it)


PENDING, DONE, FAILED, NONE, UNKNOWN = (
    TransferStatus.PENDING,
    TransferStatus.DONE,
    TransferStatus.FAILED,
    TransferStatus.NONE,
    TransferStatus.UNKNOWN,
)


def failed(reason: object) -> str:
    """The status value of a failure: ``"failed: <reason>"``."""
    return f"{TransferStatus.FAILED}: {reason}"


def parse_status(value: object) -> tuple[TransferStatus, str]:
    """``(status, reason)`` of a status value (the reason is empty but for failures); a
    value no side writes reads UNKNOWN with the value as its reason."""
    head, _, reason = str(value).partition(":")
    try:
        return TransferStatus(head.strip()), reason.strip()
    except ValueError:
        return TransferStatus.UNKNOWN, str(value)


def is_failed(value: object) -> bool:
    return parse_status(value)[0] is TransferStatus.FAILED


class StatusHistory:
    """Transfer id -> its terminal status line, the newest ``limit`` ids. Not thread-safe:
    its owner holds its own lock around it."""

    def __init__(self, limit: int = STATUS_HISTORY) -> None:
        self._limit = limit
        self._lines: OrderedDict[str, dict[str, str]] = OrderedDict()

    def record(self, transfer_id: str, line: dict[str, str]) -> None:
        self._lines[transfer_id] = line
        self._lines.move_to_end(transfer_id)
        while len(self._lines) > self._limit:
            self._lines.popitem(last=False)

    def get(self, transfer_id: str) -> dict[str, str] | None:
        """A copy of its line, or None when it is not (or no longer) kept."""
        line = self._lines.get(transfer_id)
        return dict(line) if line is not None else None

    def mark(self, transfer_id: str, field: str, value: str) -> None:
        """Set one field of a kept line (nothing when it is not kept)."""
        line = self._lines.get(transfer_id)
        if line is not None:
            line[field] = value

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._lines

    def __iter__(self) -> Iterator[str]:
        return iter(self._lines)

    def __len__(self) -> int:
        return len(self._lines)


def merge_status(kv: Mapping[str, str] | None, payload: Mapping[str, str] | None) -> dict[str, str]:
    """One status line from a KV sender's (``kv``, ``aborted``) and a runtime's
    (``payload``, ``aborted``) lines; a side that never heard of the request reads unknown."""
    kv, payload = kv or {}, payload or {}
    aborted = "true" in (kv.get("aborted"), payload.get("aborted"))
    return {
        "kv": kv.get("kv", UNKNOWN),
        "payload": payload.get("payload", UNKNOWN),
        "aborted": str(aborted).lower(),
    }


__all__ = [
    "DONE",
    "FAILED",
    "NONE",
    "PENDING",
    "STATUS_HISTORY",
    "UNKNOWN",
    "StatusHistory",
    "TransferStatus",
    "failed",
    "is_failed",
    "merge_status",
    "parse_status",
]
