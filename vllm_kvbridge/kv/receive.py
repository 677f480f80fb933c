"""The receive side: one cache of one request, from every sender rank that holds its heads.

:class:`KVReceiver` waits on a monotonic deadline (in short ``get`` slices, so shutdown
interrupts it), checks each piece against the key it came under (request id, heads, the
sender's TP) and merges the pieces into this rank's heads. When the receiver does not know
the sender's head count, it learns it from the first piece's header (possible whenever one
side of the edge has TP 1). Pieces already consumed by a failed multi-piece receive are
kept and reused by the next attempt, so no consumed payload is lost; they are kept for
:data:`PART_KEEP_S` (at least twice ``recv_timeout``) and at most :data:`MAX_PARTS` of them,
so a request nobody retries cannot grow the table, and a later attempt for a piece that was
dropped fails at once naming it. A piece that was consumed but cannot be used raises
:class:`Consumed` (the caller turns it into :class:`~vllm_kvbridge.errors.TransferCorrupt`
or a prefetch error: the data is gone).

:class:`ReceivedStore` keeps what a receive produced until the caller pops it, and attaches
it to the request object (``req.kv_transfer_data``, ``req.cfg_kv_transfer_data``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.errors import (
    ConfigError,
    ReceiveWithdrawn,
    TransferCorrupt,
    TransferError,
    TransferTimeout,
)
from vllm_kvbridge.kv.compat import check_kv_compat
from vllm_kvbridge.kv.config import KVTransferConfig, StageId
from vllm_kvbridge.kv.metrics import KVTransferMetrics
from vllm_kvbridge.kv.sender_info import StageSenderInfo
from vllm_kvbridge.kv.topology import HeadRange, Route, TPTopology, merge_head_parts
from vllm_kvbridge.wire.host_staging import tensors_to_device
from vllm_kvbridge.wire.kv_format import KVCacheTransferData

__all__ = ["Consumed", "KVReceiver", "ReceivedKV", "ReceivedStore", "request_id_of"]

logger = logging.getLogger(__name__)

#: How long one connector ``get`` may block before the receiver re-checks for shutdown.
_GET_SLICE_S = 0.25
#: How long a consumed piece waits for its request's next receive attempt (its sibling
#: pieces did not arrive in time), at least; twice ``recv_timeout`` when that is longer.
PART_KEEP_S = 120.0
#: Most consumed pieces kept waiting (the oldest goes first); as many dropped keys are
#: remembered (for ``PART_KEEP_S`` more) so that a late attempt fails naming its piece.
MAX_PARTS = 1024


class Consumed(Exception):
    """The payload was taken from the connector, then post-processing failed."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class ReceivedKV:
    """What a receive produced for one request."""

    request_id: str
    data: KVCacheTransferData
    companions: dict[str, KVCacheTransferData] = field(default_factory=dict)
    nbytes: int = 0


def request_id_of(req: Any) -> str:
    """The request id of ``req``: a str, or an object with a str ``request_id``."""
    if isinstance(req, str):
        return req
    rid = getattr(req, "request_id", None)
    if not isinstance(rid, str):
        raise ConfigError(f"cannot tell the request id of {req!r} (need a str or .request_id)")
    return rid


class ReceivedStore:
    """Received KV by request id, until popped; attached to request objects that take it.

    At most ``max_items`` are kept: beyond that the oldest goes (``on_drop`` is told), so a
    KV whose request was aborted downstream and never popped does not stay for ever.
    """

    def __init__(self, max_items: int = 256, on_drop: Callable[[str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, ReceivedKV] = {}
        self._max_items, self._on_drop = max_items, on_drop

    def put(self, req: Any, rec: ReceivedKV) -> None:
        dropped = []
        with self._lock:
            self._items.pop(rec.request_id, None)  # re-put: it becomes the newest
            self._items[rec.request_id] = rec
            while len(self._items) > self._max_items:
                dropped.append(self._items.pop(next(iter(self._items))).request_id)
        for rid in dropped:
            logger.warning("received KV of %s dropped unconsumed (over max_unconsumed)", rid)
            if self._on_drop is not None:
                self._on_drop(rid)
        if isinstance(req, str):
            return
        try:
            req.kv_transfer_data = rec.data
            req.cfg_kv_transfer_data = dict(rec.companions)
        except AttributeError:  # slotted / frozen request objects: results stay in pop()
            pass

    def get(self, request_id: str) -> ReceivedKV | None:
        with self._lock:
            return self._items.get(request_id)

    def pop(self, request_id: str) -> ReceivedKV | None:
        with self._lock:
            return self._items.pop(request_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


class ReadLedger:
    """Which requests' KV this consumer has read, and which it gave up (withdrawn, because
    their producer was lost with the unread data). Both are decided here under one lock, so
    a request is never both: a receive that completes after a withdrawal is discarded, and
    a withdrawal after a completed receive is refused. Bounded: the oldest marks go first."""

    def __init__(self, max_items: int = 4096) -> None:
        self._lock = threading.Lock()
        self._read: OrderedDict[str, None] = OrderedDict()
        self._withdrawn: OrderedDict[str, None] = OrderedDict()
        self._max_items = max_items

    def _mark(self, marks: OrderedDict[str, None], rid: str) -> None:
        marks[rid] = None
        marks.move_to_end(rid)
        while len(marks) > self._max_items:
            marks.popitem(last=False)

    def commit(self, rid: str) -> None:
        """``rid``'s KV was received: it is read now. Raises :class:`ReceiveWithdrawn` when
        it was withdrawn first (the caller drops what it got)."""
        with self._lock:
            if rid in self._withdrawn:
                raise ReceiveWithdrawn(f"KV of {rid} arrived after its receive was withdrawn")
            self._mark(self._read, rid)

    def withdraw(self, rid: str) -> bool:
        """Give ``rid`` up unless it was read; True when it is withdrawn now (or was)."""
        with self._lock:
            if rid in self._read:
                return False
            self._mark(self._withdrawn, rid)
            return True

    def is_withdrawn(self, rid: str) -> bool:
        with self._lock:
            return rid in self._withdrawn

    def forget(self, rid: str) -> None:
        """``rid`` left this stage: its id may come again (a new request)."""
        with self._lock:
            self._read.pop(rid, None)
            self._withdrawn.pop(rid, None)


class KVReceiver:
    """Receives one cache (``purpose``) of a request: every route to this rank, merged."""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        tp_rank: int,
        num_kv_heads: int | None,
        topology: Callable[[int | None], TPTopology],
        connector: Callable[[], Connector],
        metrics: KVTransferMetrics,
        sender_info: StageSenderInfo,
        stop: threading.Event,
        withdrawn: Callable[[str], bool] | None = None,
    ) -> None:
        self._config, self._tp_rank, self._num_kv_heads = config, tp_rank, num_kv_heads
        self._topology, self._connector, self._metrics = topology, connector, metrics
        self._sender_info, self._stop = sender_info, stop
        #: request id -> whether its consumer gave it up (its producer was lost): asked
        #: between get slices, so such a receive stops at once, not at its deadline.
        self._withdrawn = withdrawn or (lambda rid: False)
        self._lock = threading.Lock()
        # consumed pieces awaiting their siblings: key -> (when kept, piece); oldest first
        self._parts: OrderedDict[str, tuple[float, KVCacheTransferData]] = OrderedDict()
        self._dropped: OrderedDict[str, float] = OrderedDict()  # key -> when it was dropped
        self._keep_s = max(PART_KEEP_S, 2 * float(config.recv_timeout))

    def clear(self) -> None:
        with self._lock:
            self._parts.clear()
            self._dropped.clear()

    def waiting_parts(self) -> int:
        """Consumed pieces kept for a next receive attempt of their request."""
        with self._lock:
            self._prune_locked()
            return len(self._parts)

    def _prune_locked(self) -> None:
        now = time.monotonic()
        while self._parts:
            key, (kept_at, _) = next(iter(self._parts.items()))
            if now - kept_at <= self._keep_s and len(self._parts) <= MAX_PARTS:
                break
            del self._parts[key]
            self._dropped[key] = now
            logger.warning(
                "KV piece %s dropped: its request was not received again within %gs", key, self._keep_s
            )
        while self._dropped:
            key, dropped_at = next(iter(self._dropped.items()))
            if now - dropped_at <= self._keep_s and len(self._dropped) <= MAX_PARTS:
                break
            del self._dropped[key]

    def _take_part(self, key: str) -> KVCacheTransferData | None:
        """The kept piece of ``key`` (forgotten here), or None when there is none; raises
        :class:`Consumed` when it was consumed earlier and has been dropped since."""
        with self._lock:
            self._prune_locked()
            got = self._parts.pop(key, None)
            if got is None and key in self._dropped:
                raise Consumed(
                    TransferError(
                        f"KV piece {key} was consumed by an earlier attempt and dropped after "
                        f"{self._keep_s:g}s without the other pieces of its cache"
                    )
                )
            return got[1] if got is not None else None

    def _keep_part(self, key: str, data: KVCacheTransferData) -> None:
        with self._lock:
            self._parts[key] = (time.monotonic(), data)
            self._parts.move_to_end(key)
            self._prune_locked()

    def _get_one(
        self,
        conn: Connector,
        from_stage: StageId,
        key: str,
        meta: Mapping[str, Any],
        deadline: float,
        rid: str = "",
    ) -> Any:
        """``conn.get`` until ``deadline``, in slices so shutdown or a withdrawal can interrupt it."""
        while True:
            if self._stop.is_set():
                raise TransferError("KV transfer manager is shut down")
            if self._withdrawn(rid):
                raise ReceiveWithdrawn(f"receive of KV {key} withdrawn: its producer was lost")
            now = time.monotonic()
            if now >= deadline:
                raise TransferTimeout(f"KV {key} did not arrive within {self._config.recv_timeout}s")
            try:
                got = conn.get(
                    from_stage, self._config.stage_id, key, meta, deadline=min(deadline, now + _GET_SLICE_S)
                )
            except TransferTimeout:
                continue
            if got is not None:
                return got

    def receive(
        self,
        rid: str,
        purpose: str,
        target_device: Any,
        sender_info: Mapping[str, Any] | None,
        deadline: float,
    ) -> tuple[KVCacheTransferData, int]:
        """One cache (all routes to this rank). Raises :class:`Consumed` for post-processing failures."""
        cfg = self._config
        from_stage = cfg.recv_stages[0]
        receiver_rank = 0 if cfg.distribution == "leader" else self._tp_rank
        heads = self._expected_heads(sender_info, from_stage)
        if heads is None:
            # Whatever the head count, this rank's first piece comes from sender rank 0
            # (see _expected_heads); its header tells the count, which fixes the rest.
            one = HeadRange(0, 1)  # placeholder heads; only the key (ranks) of the probe matters
            routes: Sequence[Route] = (Route(0, receiver_rank, one, one, one),)
        else:
            routes = self._topology(heads).routes_to(receiver_rank)
        conn = self._connector()
        pieces: list[tuple[Route, KVCacheTransferData]] = []
        nbytes = 0
        self._metrics.transfer_started("recv")
        start = time.perf_counter()
        try:
            i = 0
            while i < len(routes):
                route = routes[i]
                key = route.key(rid, from_stage, cfg.stage_id, purpose=purpose)
                data = self._take_part(key)
                if data is None:
                    got = self._get_one(
                        conn,
                        from_stage,
                        key,
                        self._sender_info.metadata_for(sender_info, from_stage, route.from_rank, key),
                        deadline,
                        rid,
                    )
                    try:
                        if heads is None:  # learn the head count, then check the piece against it
                            heads, routes = self._learn_heads(
                                got, rid, key, from_stage, receiver_rank, purpose
                            )
                            route = routes[0]
                        data = self._decode(got, rid, route, heads)
                    except Exception as exc:
                        raise Consumed(exc) from exc
                    self._keep_part(key, data)  # until its siblings arrived (never lose a consumed piece)
                elif heads is None:
                    heads, routes = self._learn_heads(data, rid, key, from_stage, receiver_rank, purpose)
                    route = routes[0]
                pieces.append((route, data))
                i += 1
            try:
                merged = self._merge(rid, pieces, target_device)
                check_kv_compat(merged, cfg.expect_kv, receiver=f"stage {cfg.stage_id}")
            except Exception as exc:
                raise Consumed(exc) from exc
            with self._lock:
                for route, _ in pieces:
                    self._parts.pop(route.key(rid, from_stage, cfg.stage_id, purpose=purpose), None)
            nbytes = merged.nbytes
            self._metrics.success("recv", nbytes, time.perf_counter() - start)
            return merged, nbytes
        except TransferTimeout:
            self._metrics.timeout("recv")
            raise
        except BaseException:
            self._metrics.failure("recv")
            raise
        finally:
            self._metrics.transfer_ended("recv")

    def _expected_heads(self, sender_info: Mapping[str, Any] | None, from_stage: StageId) -> int | None:
        """The sender's total KV head count, if known before anything arrived.

        Configured (``num_kv_heads``) first, else the ``num_kv_heads`` the sender put in its
        sender info (this call's, then the stage's). ``None``: learn it from the header of
        the first piece, which is only possible when that piece's key does not depend on
        the count, i.e. when one side of the edge has TP 1 (the first route to any receiver
        rank then starts at sender rank 0); otherwise a :class:`ConfigError`.
        """
        if self._num_kv_heads is not None:
            return self._num_kv_heads
        heads = self._sender_info.declared_heads(sender_info, from_stage)
        if heads is not None:
            return heads
        if self._config.from_tp > 1 and self._config.to_tp > 1:
            raise ConfigError(
                f"KV edge with from_tp={self._config.from_tp} and to_tp={self._config.to_tp}: the receiver "
                "needs num_kv_heads (configure kv_transfer.num_kv_heads, or pass the sender's info, "
                "which carries it)"
            )
        return None

    def _learn_heads(
        self, got: Any, rid: str, key: str, from_stage: StageId, receiver_rank: int, purpose: str
    ) -> tuple[int, tuple[Route, ...]]:
        """Head count from the first piece's header; the routes it implies (first = ``key``)."""
        data = _as_kv_data(got, rid)
        heads = data.num_kv_heads_total
        if heads is None:
            if data.tp_size != 1 or self._config.from_tp != 1:
                raise TransferCorrupt(f"KV of {rid}: a sliced piece without num_kv_heads_total in its header")
            # An unsliced cache from a TP-1 sender holds every head: count them.
            layer = next((t for t in data.key_cache if t is not None), None)
            if layer is None or layer.dim() != 3:
                raise TransferCorrupt(f"KV of {rid}: cannot tell its head count (no [seq, heads, dim] layer)")
            heads = int(layer.shape[1])
        if data.tp_size != self._config.from_tp:
            raise TransferCorrupt(
                f"KV of {rid} comes from a sender with TP {data.tp_size}, this edge expects "
                f"from_tp={self._config.from_tp}"
            )
        try:
            routes = self._topology(heads).routes_to(receiver_rank)
        except ConfigError as exc:
            raise TransferCorrupt(
                f"KV of {rid}: sender's head count {heads} does not fit this edge: {exc}"
            ) from exc
        if routes[0].key(rid, from_stage, self._config.stage_id, purpose=purpose) != key:
            raise TransferCorrupt(f"KV of {rid}: {heads} heads imply another first piece than {key}")
        return heads, routes

    @staticmethod
    def _decode(got: Any, rid: str, route: Route, heads: int | None = None) -> KVCacheTransferData:
        got = _as_kv_data(got, rid)
        if got.request_id != rid:
            raise TransferCorrupt(f"received KV of request {got.request_id!r} under the key of {rid!r}")
        if heads is not None and got.num_kv_heads_total is not None and got.num_kv_heads_total != heads:
            raise TransferCorrupt(
                f"received KV of {rid} has {got.num_kv_heads_total} KV heads in all; this stage expects "
                f"{heads} (kv_transfer.num_kv_heads / the model's head count)"
            )
        if got.head_start is not None and (got.head_start, got.head_end) != (
            route.global_heads.start,
            route.global_heads.end,
        ):
            raise TransferCorrupt(
                f"received heads [{got.head_start}, {got.head_end}) for {rid}, expected "
                f"[{route.global_heads.start}, {route.global_heads.end})"
            )
        return got

    @staticmethod
    def _merge(
        rid: str, pieces: list[tuple[Route, KVCacheTransferData]], target_device: Any
    ) -> KVCacheTransferData:
        first = pieces[0][1]
        if len(pieces) == 1:
            merged_k, merged_v = list(first.key_cache), list(first.value_cache)
        else:
            n_layers = first.num_layers
            if any(
                p.num_layers != n_layers or p.seq_len != first.seq_len or p.layer_starts != first.layer_starts
                for _, p in pieces
            ):
                raise TransferCorrupt(f"TP pieces of {rid} disagree on layers, seq_len or layer windows")
            total = sum(r.dst_heads.size for r, _ in pieces)
            merged_k, merged_v = [], []
            for layer in range(n_layers):
                merged_k.append(
                    merge_head_parts([(r.dst_heads, p.key_cache[layer]) for r, p in pieces], total)
                )
                merged_v.append(
                    merge_head_parts([(r.dst_heads, p.value_cache[layer]) for r, p in pieces], total)
                )
        if target_device is not None:
            # One copy per received buffer, not a blocking copy per tensor (on CUDA: pinned
            # staging and one non-blocking transfer).
            moved = tensors_to_device([*merged_k, *merged_v], target_device)
            merged_k, merged_v = moved[: len(merged_k)], moved[len(merged_k) :]
        heads = [r.global_heads for r, _ in pieces]
        return KVCacheTransferData(
            request_id=rid,
            layer_blocks={"key_cache": merged_k, "value_cache": merged_v},
            block_ids=list(first.block_ids),
            metadata=dict(first.metadata),
            seq_len=first.seq_len,
            block_size=first.block_size,
            tp_rank=first.tp_rank if len(pieces) == 1 else 0,
            tp_size=first.tp_size,
            head_start=None if first.head_start is None else min(h.start for h in heads),
            head_end=None if first.head_end is None else max(h.end for h in heads),
            num_kv_heads_total=first.num_kv_heads_total,
            layer_starts=first.layer_starts,
        )


def _as_kv_data(got: Any, rid: str) -> KVCacheTransferData:
    # Connectors return what was put: the manager puts KVCacheTransferData, nothing else.
    if not isinstance(got, KVCacheTransferData):
        raise TransferCorrupt(f"expected KVCacheTransferData for {rid}, got {type(got).__name__}")
    return got
