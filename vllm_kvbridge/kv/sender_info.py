"""Sender info: what a sent KV's receiver needs to pass to its connector's ``get``.

Sender side, :class:`SentInfoTable`: the put metadata of every completed send, filed under
the engine's request id and the transfer id, kept for a TTL and only for the newest ids
(the table never grows with the number of requests); and the ids whose KV was withdrawn,
so that a send of theirs still in flight is withdrawn when it completes.

Receiver side, :class:`StageSenderInfo`: how to reach each sending stage, and the lookup of
one piece's metadata. The format is ``{"ranks": {"<sender rank>": meta}, "keys": {"<key>":
meta}}`` (both optional; a per-key entry wins over a per-rank entry). A flat dict (no
``"ranks"``/``"keys"``) is used for every sender rank; with ``"port_offset_by_rank": true``
and an ``"endpoint"`` ``tcp://host:port``, sender rank ``r`` is reached at ``port + r`` (one
server per TP rank). A sender puts ``"num_kv_heads"`` in its info so that a receiver that
is not configured with the count can still route.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.kv.config import StageId

__all__ = ["WITHDRAWN_KEEP_S", "SentInfoTable", "StageSenderInfo"]

#: Longest a withdrawn id keeps refusing sends that complete later: a send owed or in
#: flight when its request failed completes within this (the pipeline refuses to reuse a
#: failed request's id for longer, ``pipeline.engines.ABORTED_KEEP_S``).
WITHDRAWN_KEEP_S = 300.0


@dataclass
class _SentInfo:
    info: dict[str, Any]
    at: float  # time.monotonic() of the send's completion
    ids: tuple[str, ...]  # every id it is filed under (engine's and transfer id)


class SentInfoTable:
    """Sender info of completed sends, bounded by ``ttl_s`` and ``max_entries`` ids."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 4096) -> None:
        if not ttl_s > 0 or max_entries < 1:
            raise ConfigError("sender_info_ttl_s must be > 0 and max_sender_info >= 1")
        self._ttl_s, self._max = float(ttl_s), int(max_entries)
        self._lock = threading.Lock()
        # id (engine's and transfer id) -> record; oldest first
        self._entries: OrderedDict[str, _SentInfo] = OrderedDict()
        # withdrawn id -> when; bounded like the entries (a send completing later than
        # this keeps is not withdrawn: the connector's own TTL is the backstop)
        self._withdrawn: OrderedDict[str, float] = OrderedDict()
        self._withdrawn_keep_s = min(self._ttl_s, WITHDRAWN_KEEP_S)

    def record(self, ids: tuple[str, ...], info: dict[str, Any]) -> bool:
        """File ``info`` under every id in ``ids`` (duplicates are fine). False, filing
        nothing, when one of the ids was withdrawn: the caller withdraws what it put."""
        entry = _SentInfo(info, time.monotonic(), tuple(dict.fromkeys(ids)))
        with self._lock:
            self._prune_locked()
            if any(rid in self._withdrawn for rid in entry.ids):
                return False
            for rid in entry.ids:
                self._entries[rid] = entry
                self._entries.move_to_end(rid)
            self._prune_locked()
            return True

    def withdraw(self, request_id: str) -> dict[str, Any] | None:
        """Forget ``request_id``'s info (all of its ids) and refuse any later :meth:`record`
        of it, atomically: a send that completes after this is the caller's to withdraw.
        Returns the info there was (None: nothing sent yet)."""
        with self._lock:
            self._prune_locked()
            now = time.monotonic()
            entry = self._pop_locked(request_id)
            for rid in entry.ids if entry is not None else (request_id,):
                self._withdrawn[rid] = now
                self._withdrawn.move_to_end(rid)
            return entry.info if entry is not None else None

    def is_withdrawn(self, request_id: str) -> bool:
        """Whether ``request_id`` was withdrawn (a send of it still under way can give up)."""
        with self._lock:
            return request_id in self._withdrawn

    def _pop_locked(self, request_id: str) -> _SentInfo | None:
        """Remove ``request_id``'s record under every id it is filed under."""
        entry = self._entries.get(request_id)
        for rid in entry.ids if entry is not None else ():
            self._entries.pop(rid, None)
        return entry

    def _prune_locked(self) -> None:
        """Drop sender info (and withdrawn ids) past the TTL, then the oldest beyond
        ``max_entries`` ids."""
        now = time.monotonic()
        while self._withdrawn and (
            next(iter(self._withdrawn.values())) <= now - self._withdrawn_keep_s
            or len(self._withdrawn) > self._max
        ):
            self._withdrawn.popitem(last=False)
        expire = now - self._ttl_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.at > expire and len(self._entries) <= self._max:
                break
            for rid in oldest.ids:
                self._entries.pop(rid, None)

    def get(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            self._prune_locked()
            entry = self._entries.get(request_id)
            return entry.info if entry is not None else None

    def forget(self, request_id: str) -> bool:
        """Drop a request's info under all of its ids; True if there was any."""
        with self._lock:
            return self._pop_locked(request_id) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class StageSenderInfo:
    """Receiver side: the sender info of each sending stage, and per-piece lookups."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_stage: dict[str, Mapping[str, Any]] = {}

    def update(self, stage: StageId | None, sender_info: Mapping[str, Any]) -> None:
        if not isinstance(sender_info, Mapping):
            raise ConfigError(f"sender_info must be a mapping, got {type(sender_info).__name__}")
        with self._lock:
            self._by_stage[str(stage)] = dict(sender_info)

    def of_stage(self, stage: StageId) -> Mapping[str, Any] | None:
        with self._lock:
            return self._by_stage.get(str(stage))

    def metadata_for(
        self, info: Mapping[str, Any] | None, stage: StageId, rank: int, key: str
    ) -> dict[str, Any]:
        """The ``get`` metadata of piece ``key`` from sender ``rank``: this call's info first,
        then the stage's (see the module docstring); ``{}`` when neither knows it."""
        for source in (info, self.of_stage(stage)):
            if not source:
                continue
            if "keys" in source or "ranks" in source:
                meta = (source.get("keys") or {}).get(key) or (source.get("ranks") or {}).get(str(rank))
                if meta is not None:
                    return dict(meta)
                continue
            meta = dict(source)
            if meta.pop("port_offset_by_rank", False) and isinstance(meta.get("endpoint"), str):
                m = re.fullmatch(r"(tcp://.+):(\d+)", meta["endpoint"])
                if m is None:
                    raise ConfigError(f"cannot offset the port of endpoint {meta['endpoint']!r}")
                meta["endpoint"] = f"{m.group(1)}:{int(m.group(2)) + rank}"
            return meta
        return {}

    def declared_heads(self, info: Mapping[str, Any] | None, stage: StageId) -> int | None:
        """The ``num_kv_heads`` a sender declared (this call's info, then the stage's)."""
        for source in (info, self.of_stage(stage)):
            heads = source.get("num_kv_heads") if isinstance(source, Mapping) else None
            if heads is not None:
                if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
                    raise ConfigError(f"sender info num_kv_heads must be a positive int, got {heads!r}")
                return heads
        return None
