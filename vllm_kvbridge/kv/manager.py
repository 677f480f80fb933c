"""``KVTransferManager``: gather a finished request's KV, send it, receive it, prefetch it.

Sender side (model thread -> I/O thread)::

    submitted = mgr.handle_finished_requests_kv_transfer(finished_reqs, kv_caches, block_size, dtype)
    ...later...
    done, failed = mgr.get_finished()       # per request id, each reported exactly once
    info = mgr.get_sender_info(request_id)  # forward to the receiving stage

``finished_reqs`` maps the engine's request id to ``{"block_ids": [...], "seq_len": int}``
plus optional ``"purpose"`` (default ``"kv"``; CFG companions use their own purpose, e.g.
``"cfg_neg"``, under the *primary's* request id) and ``"metadata"`` (JSON-safe dict).
``block_ids`` is the request's block table in token order (a list, or a tuple of
per-KV-cache-group lists of which the first is used). ``request_id_resolver`` maps the
engine's id to the id used in transfer keys (vLLM adds suffixes; the receiver knows the
user's id). The gather (one indexed copy per layer, only the heads the receivers need)
runs on the calling thread, because the caller frees the blocks afterwards; packing and
the connector's put run on one I/O thread, with ``send_retries`` retries and exponential
backoff. A request is reported ``done`` only when every put of it succeeded; otherwise
``failed`` (never both, never silently dropped). Ids in ``get_finished`` are the keys of
``finished_reqs``.

Receiver side: :meth:`receive_kv_cache_for_request` waits on a monotonic deadline of
``recv_timeout`` seconds and **raises** :class:`TransferTimeout` when the KV did not come
(``(None, 0)`` is returned only when this stage is not configured to receive KV at all).
Post-processing failures of received data (wrong request id or heads, undecodable) raise
:class:`TransferCorrupt`. :meth:`receive_multi_kv_cache` receives the primary KV plus CFG
companions through one hook, ``cfg_kv_collect_func(req) -> Iterable[str]``, which returns
the *purposes* of the companion caches the request needs; results are attached to
``req`` as ``req.kv_transfer_data`` (:class:`KVCacheTransferData`) and
``req.cfg_kv_transfer_data`` (``{purpose: KVCacheTransferData}``) when ``req`` accepts
attributes, and kept until :meth:`pop_received`.

Sender info (what the receiver passes to a connector's ``get`` as metadata) is
``{"ranks": {"<sender rank>": meta}, "keys": {"<key>": meta}}`` (both optional): a per-key
entry wins over a per-rank entry. A flat dict (no ``"ranks"``/``"keys"``) is used for every
sender rank; with ``"port_offset_by_rank": true`` and an ``"endpoint"`` ``tcp://host:port``,
sender rank ``r`` is reached at ``port + r`` (one server per TP rank).

TP: :mod:`vllm_kvbridge.kv.topology` decides which sender rank sends which heads to which
receiver rank; keys carry both ranks. ``distribution="leader"``: group rank 0 of the
stage's process group receives everything and broadcasts one packed uint8 tensor per cache
to the other ranks (:meth:`receive_multi_kv_cache_distributed`, :meth:`distribute_kv_cache`);
for it the edge's ``to_tp`` must be 1.

Prefetch: :meth:`start_prefetch` starts background receives (at most
``max_prefetch_inflight`` at once); :meth:`consume_and_distribute_kv_cache` uses a finished
prefetch; on a miss or a recoverable failure (nothing was consumed: timeout, transport
error) it receives synchronously; when a payload was consumed but its post-processing
failed it raises :class:`KVPrefetchConsumeError` and does not retry (the data is gone).
Pieces already consumed by a failed receive of a multi-rank request are kept and reused by
the next attempt, so no consumed payload is lost. :meth:`shutdown` cancels and joins
everything and closes the connector.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.connectors.keys import KV
from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import (
    ConfigError,
    KVBridgeError,
    TransferCorrupt,
    TransferError,
    TransferTimeout,
)
from vllm_kvbridge.kv.config import KVTransferConfig, StageId
from vllm_kvbridge.kv.layout import KVCacheLayout, cpu_layout, gather_layers, packed_layout
from vllm_kvbridge.kv.metrics import KVTransferMetrics
from vllm_kvbridge.kv.topology import HeadRange, Route, TPTopology, merge_head_parts
from vllm_kvbridge.wire.kv_format import KVCacheTransferData

logger = logging.getLogger(__name__)

__all__ = ["KVPrefetchConsumeError", "KVTransferManager", "ReceivedKV"]

#: How long one connector ``get`` may block before the manager re-checks for shutdown.
_GET_SLICE_S = 0.25


class KVPrefetchConsumeError(TransferError):
    """A prefetched KV payload was consumed but could not be used; it is not retried."""


class _Consumed(Exception):
    """Internal: the payload was taken from the connector, then post-processing failed."""

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


@dataclass
class _SendJob:
    engine_id: str
    request_id: str
    to_stage: StageId
    parts: list[tuple[str, int, KVCacheTransferData]]  # (key, from_rank, data)
    num_kv_heads: int = 0


@dataclass
class _SentInfo:
    info: dict[str, Any]
    at: float  # time.monotonic() of the send's completion
    ids: tuple[str, ...]  # every id it is filed under (engine's and transfer id)


def _request_id(req: Any) -> str:
    if isinstance(req, str):
        return req
    rid = getattr(req, "request_id", None)
    if not isinstance(rid, str):
        raise ConfigError(f"cannot tell the request id of {req!r} (need a str or .request_id)")
    return rid


def _attach(req: Any, rec: ReceivedKV) -> None:
    if isinstance(req, str):
        return
    try:
        req.kv_transfer_data = rec.data
        req.cfg_kv_transfer_data = dict(rec.companions)
    except AttributeError:  # slotted / frozen request objects: results stay in pop_received
        pass


def _to_device(data: KVCacheTransferData, device: Any) -> KVCacheTransferData:
    """A copy of ``data`` whose tensors live on ``device`` (a view-free, owned copy)."""
    blocks = {
        name: [None if t is None else t.to(device, copy=True) for t in tensors]
        for name, tensors in data.layer_blocks.items()
    }
    return KVCacheTransferData(
        request_id=data.request_id,
        layer_blocks=blocks,
        block_ids=list(data.block_ids),
        metadata=dict(data.metadata),
        seq_len=data.seq_len,
        block_size=data.block_size,
        tp_rank=data.tp_rank,
        tp_size=data.tp_size,
        head_start=data.head_start,
        head_end=data.head_end,
        num_kv_heads_total=data.num_kv_heads_total,
    )


def _free_memory_ratio(device: torch.device) -> float:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free / total
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        total = int(info["MemTotal"].split()[0])
        avail = int(info["MemAvailable"].split()[0])
        return avail / total
    except (OSError, KeyError, ValueError):
        return 1.0


class KVTransferManager:
    """KV transfer of one stage rank (see the module docstring for the contract)."""

    def __init__(
        self,
        config: KVTransferConfig,
        *,
        num_kv_heads: int | None = None,
        tp_rank: int | None = None,
        layout: KVCacheLayout | None = None,
        process_group: Any = None,
        connector: Connector | None = None,
        sender_info_ttl_s: float = 600.0,
        max_sender_info: int = 4096,
    ) -> None:
        if not isinstance(config, KVTransferConfig):
            raise ConfigError(f"config must be a KVTransferConfig, got {type(config).__name__}")
        self.config = config
        self.tp_rank = tp_rank if tp_rank is not None else (config.tp_rank or 0)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else config.num_kv_heads
        self.layout = layout
        self.process_group = process_group
        if config.distribution == "leader" and config.need_recv_cache and config.to_tp != 1:
            raise ConfigError(
                "kv_transfer.to_tp must be 1 with distribution: leader (rank 0 receives all heads)"
            )
        self._connector = connector
        self._connector_lock = threading.Lock()
        self.metrics = KVTransferMetrics(config.stage_id, connector.name if connector else config.connector)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # sender state
        self._queue: queue.Queue[_SendJob | None] = queue.Queue()
        self._io_thread: threading.Thread | None = None
        self._pending_sends: set[str] = set()
        self._done: list[str] = []
        self._failed: dict[str, str] = {}
        # id (engine's and transfer id) -> record; oldest first, bounded (see get_sender_info)
        if not sender_info_ttl_s > 0 or max_sender_info < 1:
            raise ConfigError("sender_info_ttl_s must be > 0 and max_sender_info >= 1")
        self._sent_info: OrderedDict[str, _SentInfo] = OrderedDict()
        self._sent_info_ttl_s, self._max_sent_info = float(sender_info_ttl_s), int(max_sender_info)
        # receiver state
        self._stage_sender_info: dict[str, Mapping[str, Any]] = {}
        self._received: dict[str, ReceivedKV] = {}
        self._parts: dict[str, KVCacheTransferData] = {}  # consumed pieces awaiting their siblings
        self._prefetch: dict[str, Future[ReceivedKV]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_config: Any = None, **kwargs: Any) -> KVTransferManager:
        """Build from vLLM's config: ``vllm_config.additional_config["kvbridge"]["kv_transfer"]``.

        That entry is a dict of :class:`KVTransferConfig` fields. ``num_kv_heads`` comes from
        ``model_config.get_total_num_kv_heads()`` (``model_config`` defaults to
        ``vllm_config.model_config``) and ``tp_rank`` from vLLM's TP group when initialised.
        """
        extra = getattr(vllm_config, "additional_config", None) or {}
        section = (extra.get("kvbridge") or {}).get("kv_transfer") if isinstance(extra, Mapping) else None
        if section is None:
            raise ConfigError('additional_config["kvbridge"]["kv_transfer"] is missing')
        config = KVTransferConfig.from_dict(section, path="additional_config.kvbridge.kv_transfer")
        model_config = model_config or getattr(vllm_config, "model_config", None)
        if "num_kv_heads" not in kwargs and config.num_kv_heads is None and model_config is not None:
            kwargs["num_kv_heads"] = int(model_config.get_total_num_kv_heads())
        if "tp_rank" not in kwargs and config.tp_rank is None:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                kwargs["tp_rank"] = get_tensor_model_parallel_rank()
            except (ImportError, AssertionError, RuntimeError):
                kwargs["tp_rank"] = 0
        return cls(config, **kwargs)

    @classmethod
    def from_stage_config(cls, stage_config: Any, **kwargs: Any) -> KVTransferManager:
        """Build from a stage config: a mapping or object with ``kv_transfer`` (dict or Struct)
        and optionally ``stage_id`` (which fills ``kv_transfer.stage_id`` when absent)."""

        def get(obj: Any, name: str) -> Any:
            return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)

        section = get(stage_config, "kv_transfer")
        if section is None:
            raise ConfigError("stage config has no kv_transfer section")
        if isinstance(section, KVTransferConfig):
            return cls(section, **kwargs)
        if not isinstance(section, Mapping):
            import msgspec

            section = msgspec.to_builtins(section)
        section = dict(section)
        stage_id = get(stage_config, "stage_id")
        if stage_id is not None:
            section.setdefault("stage_id", stage_id)
        return cls(KVTransferConfig.from_dict(section), **kwargs)

    # -- connector ---------------------------------------------------------------------
    @property
    def connector(self) -> Connector:
        """The connector, created on first use; a failed creation is retried next time."""
        conn = self._connector
        if conn is not None:
            return conn
        with self._connector_lock:
            if self._closed:
                raise TransferError("KV transfer manager is shut down")
            if self._connector is None:
                self._connector = create_connector(self.config.connector, self.config.connector_config)
            return self._connector

    @property
    def send_stages(self) -> list[StageId]:
        return self.config.send_stages

    @property
    def recv_stages(self) -> list[StageId]:
        return self.config.recv_stages

    def topology(self, num_kv_heads: int | None = None) -> TPTopology:
        heads = num_kv_heads or self.num_kv_heads
        if heads is None:
            if self.config.from_tp == 1 and self.config.to_tp == 1:
                heads = 1  # placeholder: one route, all heads
            else:
                raise ConfigError("num_kv_heads is needed for KV transfer with TP > 1")
        return TPTopology(self.config.from_tp, self.config.to_tp, heads)

    # -- sending -----------------------------------------------------------------------
    def _layout_for(
        self, kv_caches: Sequence[torch.Tensor], block_size: int, cache_dtype: Any
    ) -> KVCacheLayout:
        if self.layout is not None:
            return self.layout
        # vLLM 0.32 gives every backend the same logical [B, H, N, C] view; what differs is
        # the page content: the CPU kernel's format on CPU, K|V packed in C on CUDA backends.
        first = kv_caches[0]
        if (
            isinstance(cache_dtype, str)
            and cache_dtype not in ("auto",)
            and "float" not in cache_dtype
            and "half" not in cache_dtype
        ):
            raise ConfigError(f"quantized KV cache dtype {cache_dtype!r} is not supported")
        if first.dim() != 4:
            raise ConfigError(
                f"expected per-layer caches [num_blocks, heads, block, C], got {tuple(first.shape)}"
            )
        heads, n, c = int(first.shape[1]), int(first.shape[2]), int(first.shape[3])
        if first.device.type == "cpu":
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(first.dtype, n, c // 2, "auto")
            layout = cpu_layout(heads, c // 2, n, first.dtype, isa=isa)
        else:
            per = block_size // n if block_size and block_size % n == 0 else 1
            layout = packed_layout(heads, c // 2, n, first.dtype, blocks_per_block=per)
        if block_size and layout.tokens_per_block != block_size:
            raise ConfigError(f"block_size {block_size} does not match the cache's blocks of {n} tokens")
        return layout

    def handle_finished_requests_kv_transfer(
        self,
        finished_reqs: Mapping[str, Mapping[str, Any]],
        kv_caches: Sequence[torch.Tensor],
        block_size: int,
        cache_dtype: Any,
        request_id_resolver: Callable[[str], str] | None = None,
    ) -> list[str]:
        """Gather each finished request's KV now and queue its send; return the submitted ids.

        A request whose gather fails (bad block ids, ...) is not submitted and is reported
        in ``get_finished()[1]`` right away.
        """
        if not self.config.need_send_cache or not finished_reqs:
            return []
        if self._closed:
            raise TransferError("KV transfer manager is shut down")
        if not kv_caches:
            raise ConfigError("kv_caches is empty")
        layout = self._layout_for(kv_caches, block_size, cache_dtype)
        local_heads = layout.num_kv_heads
        total_heads = self.num_kv_heads or (local_heads if self.config.from_tp == 1 else None)
        topo = self.topology(total_heads)
        routes = topo.routes_from(self.tp_rank)
        to_stage = self.config.to_stage
        submitted: list[str] = []
        for engine_id, info in finished_reqs.items():
            try:
                rid = request_id_resolver(engine_id) if request_id_resolver else engine_id
                job = self._gather_job(engine_id, rid, info, kv_caches, layout, topo, routes, to_stage)
            except Exception as exc:  # one bad request must not stop the others
                logger.error("KV gather for request %s failed: %s", engine_id, exc)
                self.metrics.failure("send")
                with self._lock:
                    self._failed[engine_id] = f"gather failed: {exc}"
                continue
            self._submit(job)
            submitted.append(engine_id)
        return submitted

    def _gather_job(
        self,
        engine_id: str,
        rid: str,
        info: Mapping[str, Any],
        kv_caches: Sequence[torch.Tensor],
        layout: KVCacheLayout,
        topo: TPTopology,
        routes: Sequence[Route],
        to_stage: StageId,
    ) -> _SendJob:
        block_ids = info.get("block_ids")
        if isinstance(block_ids, tuple) and block_ids and isinstance(block_ids[0], list | tuple):
            block_ids = block_ids[0]  # per-KV-cache-group tuple: the attention group
        seq_len = info.get("seq_len")
        purpose = info.get("purpose", KV)
        metadata = dict(info.get("metadata") or {})
        metadata.setdefault("purpose", purpose)
        parts = []
        for route in routes:
            keys, values = gather_layers(
                kv_caches,
                layout,
                block_ids,
                seq_len,
                head_start=route.src_heads.start,
                head_end=route.src_heads.end,
            )
            data = KVCacheTransferData(
                request_id=rid,
                layer_blocks={"key_cache": keys, "value_cache": values},
                block_ids=[int(b) for b in list(block_ids)[: -(-seq_len // layout.tokens_per_block)]],
                metadata=metadata,
                seq_len=seq_len,
                block_size=layout.tokens_per_block,
                tp_rank=route.from_rank,
                tp_size=topo.sender_tp,
                head_start=route.global_heads.start,
                head_end=route.global_heads.end,
                num_kv_heads_total=topo.num_kv_heads,
            )
            key = route.key(rid, self.config.stage_id, to_stage, purpose=purpose)
            parts.append((key, route.from_rank, data))
        return _SendJob(engine_id, rid, to_stage, parts, topo.num_kv_heads)

    def _submit(self, job: _SendJob) -> None:
        with self._lock:
            if self._io_thread is None:
                self._io_thread = threading.Thread(target=self._io_loop, name="kvbridge-kv-send", daemon=True)
                self._io_thread.start()
            self._pending_sends.add(job.engine_id)
        self.metrics.transfer_started("send")
        self._queue.put(job)

    def _io_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                error = self._send(job) if not self._stop.is_set() else "manager shut down"
            except Exception as exc:  # never let the I/O thread die
                error = f"unexpected: {exc!r}"
            with self._lock:
                self._pending_sends.discard(job.engine_id)
                if error is None:
                    self._done.append(job.engine_id)
                else:
                    self._failed[job.engine_id] = error
            if error is not None:
                logger.error("KV send of request %s failed: %s", job.engine_id, error)
                self.metrics.failure("send")
            self.metrics.transfer_ended("send")

    def _send(self, job: _SendJob) -> str | None:
        cfg = self.config
        infos: dict[str, Any] = {"ranks": {}, "keys": {}}
        put_keys: list[str] = []
        for key, rank, data in job.parts:
            error = "no attempt"
            start = time.perf_counter()
            for attempt in range(cfg.send_retries + 1):
                if attempt:
                    self.metrics.retry("send")
                    if self._stop.wait(cfg.backoff(attempt - 1)):
                        error = "manager shut down"
                        break
                try:
                    conn = self.connector
                    payload = data.to_gpu_tensor() if conn.supports_raw_data else data
                    result = conn.put(cfg.stage_id, job.to_stage, key, payload)
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    continue
                if result.ok:
                    infos["ranks"][str(rank)] = result.metadata
                    infos["keys"][key] = result.metadata
                    put_keys.append(key)
                    self.metrics.success("send", result.nbytes, time.perf_counter() - start)
                    error = None
                    break
                error = result.error or "put returned ok=False"
            if error is not None:
                for done_key in put_keys:  # release what this request already put
                    try:
                        self.connector.cleanup(done_key)
                    except Exception:
                        pass
                return f"{key}: {error} (after {cfg.send_retries + 1} attempts)"
        infos["num_kv_heads"] = job.num_kv_heads  # lets a receiver that is not configured check
        record = _SentInfo(infos, time.monotonic(), tuple(dict.fromkeys((job.engine_id, job.request_id))))
        with self._lock:
            for rid in record.ids:
                self._sent_info[rid] = record
                self._sent_info.move_to_end(rid)
            self._prune_sent_info_locked()
        return None

    def _prune_sent_info_locked(self) -> None:
        """Drop sender info past its TTL, then the oldest beyond ``max_sender_info`` ids."""
        expire = time.monotonic() - self._sent_info_ttl_s
        while self._sent_info:
            oldest = next(iter(self._sent_info.values()))
            if oldest.at > expire and len(self._sent_info) <= self._max_sent_info:
                break
            for rid in oldest.ids:
                self._sent_info.pop(rid, None)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(done, failed)`` request ids since the last call; each id is reported once."""
        with self._lock:
            done, self._done = set(self._done), []
            failed = set(self._failed)
            self._failed.clear()
        return done, failed

    def get_sender_info(self, request_id: str) -> dict[str, Any] | None:
        """The put metadata of a sent request, for the receiver (engine's or transfer id).

        ``{"ranks": ..., "keys": ..., "num_kv_heads": n}``. Kept from the moment the send
        completed until :meth:`forget_sender_info`, for ``sender_info_ttl_s`` seconds at most,
        and only for the newest ``max_sender_info`` ids, so the table cannot grow with the
        number of requests (None once forgotten, as for a request never sent).
        """
        with self._lock:
            self._prune_sent_info_locked()
            record = self._sent_info.get(request_id)
            return record.info if record is not None else None

    def forget_sender_info(self, request_id: str) -> bool:
        """Drop a request's sender info (under both of its ids); True if there was any."""
        with self._lock:
            record = self._sent_info.get(request_id)
            if record is None:
                return False
            for rid in record.ids:
                self._sent_info.pop(rid, None)
            return True

    def pending_sends(self) -> int:
        with self._lock:
            return len(self._pending_sends)

    # -- receiving ---------------------------------------------------------------------
    def update_sender_info(
        self, sender_info: Mapping[str, Any], sender_stage_id: StageId | None = None
    ) -> None:
        """Remember how to reach a sending stage (see the module docstring for the format)."""
        if not isinstance(sender_info, Mapping):
            raise ConfigError(f"sender_info must be a mapping, got {type(sender_info).__name__}")
        stage = sender_stage_id if sender_stage_id is not None else (self.recv_stages or [None])[0]
        with self._lock:
            self._stage_sender_info[str(stage)] = dict(sender_info)

    def _metadata_for(
        self, info: Mapping[str, Any] | None, stage: StageId, rank: int, key: str
    ) -> dict[str, Any]:
        for source in (info, self._stage_sender_info.get(str(stage))):
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

    def _get_one(
        self, conn: Connector, from_stage: StageId, key: str, meta: Mapping[str, Any], deadline: float
    ) -> Any:
        """``conn.get`` until ``deadline``, in slices so shutdown can interrupt it."""
        while True:
            if self._stop.is_set():
                raise TransferError("KV transfer manager is shut down")
            now = time.monotonic()
            if now >= deadline:
                raise TransferTimeout(f"KV {key} did not arrive within {self.config.recv_timeout}s")
            try:
                got = conn.get(
                    from_stage, self.config.stage_id, key, meta, deadline=min(deadline, now + _GET_SLICE_S)
                )
            except TransferTimeout:
                continue
            if got is not None:
                return got

    def _receive(
        self,
        rid: str,
        purpose: str,
        target_device: Any,
        sender_info: Mapping[str, Any] | None,
        deadline: float,
    ) -> tuple[KVCacheTransferData, int]:
        """One cache (all routes to this rank). Raises _Consumed for post-processing failures."""
        from_stage = self.recv_stages[0]
        receiver_rank = 0 if self.config.distribution == "leader" else self.tp_rank
        heads = self._expected_heads(sender_info, from_stage)
        if heads is None:
            # Whatever the head count, this rank's first piece comes from sender rank 0
            # (see _expected_heads); its header tells the count, which fixes the rest.
            one = HeadRange(0, 1)  # placeholder heads; only the key (ranks) of the probe matters
            routes: Sequence[Route] = (Route(0, receiver_rank, one, one, one),)
        else:
            routes = self.topology(heads).routes_to(receiver_rank)
        conn = self.connector
        pieces: list[tuple[Route, KVCacheTransferData]] = []
        nbytes = 0
        self.metrics.transfer_started("recv")
        start = time.perf_counter()
        try:
            i = 0
            while i < len(routes):
                route = routes[i]
                key = route.key(rid, from_stage, self.config.stage_id, purpose=purpose)
                with self._lock:
                    data = self._parts.pop(key, None)
                if data is None:
                    got = self._get_one(
                        conn,
                        from_stage,
                        key,
                        self._metadata_for(sender_info, from_stage, route.from_rank, key),
                        deadline,
                    )
                    try:
                        if heads is None:  # learn the head count, then check the piece against it
                            heads, routes = self._learn_heads(
                                got, rid, key, from_stage, receiver_rank, purpose
                            )
                            route = routes[0]
                        data = self._decode(got, rid, route, heads)
                    except Exception as exc:
                        raise _Consumed(exc) from exc
                    with self._lock:  # keep it until its siblings arrived (never lose a consumed piece)
                        self._parts[key] = data
                elif heads is None:
                    heads, routes = self._learn_heads(data, rid, key, from_stage, receiver_rank, purpose)
                    route = routes[0]
                pieces.append((route, data))
                i += 1
            try:
                merged = self._merge(rid, pieces, target_device)
            except Exception as exc:
                raise _Consumed(exc) from exc
            with self._lock:
                for route, _ in pieces:
                    self._parts.pop(route.key(rid, from_stage, self.config.stage_id, purpose=purpose), None)
            nbytes = merged.nbytes
            self.metrics.success("recv", nbytes, time.perf_counter() - start)
            return merged, nbytes
        except TransferTimeout:
            self.metrics.timeout("recv")
            raise
        except BaseException:
            self.metrics.failure("recv")
            raise
        finally:
            self.metrics.transfer_ended("recv")

    def _expected_heads(self, sender_info: Mapping[str, Any] | None, from_stage: StageId) -> int | None:
        """The sender's total KV head count, if known before anything arrived.

        Configured (``num_kv_heads``) first, else the ``num_kv_heads`` the sender put in its
        sender info (this call's, then the stage's). ``None``: learn it from the header of
        the first piece, which is only possible when that piece's key does not depend on
        the count, i.e. when one side of the edge has TP 1 (the first route to any receiver
        rank then starts at sender rank 0); otherwise a :class:`ConfigError`.
        """
        if self.num_kv_heads is not None:
            return self.num_kv_heads
        for source in (sender_info, self._stage_sender_info.get(str(from_stage))):
            heads = source.get("num_kv_heads") if isinstance(source, Mapping) else None
            if heads is not None:
                if not isinstance(heads, int) or isinstance(heads, bool) or heads < 1:
                    raise ConfigError(f"sender info num_kv_heads must be a positive int, got {heads!r}")
                return heads
        if self.config.from_tp > 1 and self.config.to_tp > 1:
            raise ConfigError(
                f"KV edge with from_tp={self.config.from_tp} and to_tp={self.config.to_tp}: the receiver "
                "needs num_kv_heads (configure kv_transfer.num_kv_heads, or pass the sender's info, "
                "which carries it)"
            )
        return None

    def _learn_heads(
        self, got: Any, rid: str, key: str, from_stage: StageId, receiver_rank: int, purpose: str
    ) -> tuple[int, tuple[Route, ...]]:
        """Head count from the first piece's header; the routes it implies (first = ``key``)."""
        data = self._as_kv_data(got, rid)
        heads = data.num_kv_heads_total
        if heads is None:
            if data.tp_size != 1 or self.config.from_tp != 1:
                raise TransferCorrupt(f"KV of {rid}: a sliced piece without num_kv_heads_total in its header")
            # An unsliced cache from a TP-1 sender holds every head: count them.
            layer = next((t for t in data.key_cache if t is not None), None)
            if layer is None or layer.dim() != 3:
                raise TransferCorrupt(f"KV of {rid}: cannot tell its head count (no [seq, heads, dim] layer)")
            heads = int(layer.shape[1])
        if data.tp_size != self.config.from_tp:
            raise TransferCorrupt(
                f"KV of {rid} comes from a sender with TP {data.tp_size}, this edge expects "
                f"from_tp={self.config.from_tp}"
            )
        try:
            routes = self.topology(heads).routes_to(receiver_rank)
        except ConfigError as exc:
            raise TransferCorrupt(
                f"KV of {rid}: sender's head count {heads} does not fit this edge: {exc}"
            ) from exc
        if routes[0].key(rid, from_stage, self.config.stage_id, purpose=purpose) != key:
            raise TransferCorrupt(f"KV of {rid}: {heads} heads imply another first piece than {key}")
        return heads, routes

    @staticmethod
    def _as_kv_data(got: Any, rid: str) -> KVCacheTransferData:
        if isinstance(got, torch.Tensor):
            got = KVCacheTransferData.from_bytes_device(got, expected_request_id=rid)
        if not isinstance(got, KVCacheTransferData):
            raise TransferCorrupt(f"expected KVCacheTransferData for {rid}, got {type(got).__name__}")
        return got

    @classmethod
    def _decode(cls, got: Any, rid: str, route: Route, heads: int | None = None) -> KVCacheTransferData:
        got = cls._as_kv_data(got, rid)
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
            if any(p.num_layers != n_layers or p.seq_len != first.seq_len for _, p in pieces):
                raise TransferCorrupt(f"TP pieces of {rid} disagree on layers or seq_len")
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
            merged_k = [None if t is None else t.to(target_device) for t in merged_k]
            merged_v = [None if t is None else t.to(target_device) for t in merged_v]
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
        )

    def receive_kv_cache_for_request(
        self,
        request_id: str,
        target_device: Any = None,
        *,
        sender_info: Mapping[str, Any] | None = None,
        purpose: str = KV,
    ) -> tuple[KVCacheTransferData | None, int]:
        """Receive one request's KV (this rank's heads) within ``recv_timeout`` seconds.

        Returns ``(data, nbytes)``; ``(None, 0)`` only when this stage does not receive KV.
        Raises :class:`TransferTimeout` at the deadline, :class:`TransferCorrupt` for data
        that arrived but cannot be used, other :class:`TransferError` for transport failures.
        """
        if not self.config.need_recv_cache:
            return None, 0
        deadline = time.monotonic() + self.config.recv_timeout
        try:
            return self._receive(request_id, purpose, target_device, sender_info, deadline)
        except _Consumed as exc:
            raise TransferCorrupt(f"KV of {request_id} arrived but is unusable: {exc.cause}") from exc.cause

    def _receive_multi(
        self,
        rid: str,
        cfg_kv_collect_func: Callable[[Any], Iterable[str]] | None,
        req: Any,
        target_device: Any,
        sender_info: Mapping[str, Any] | None,
    ) -> ReceivedKV:
        deadline = time.monotonic() + self.config.recv_timeout
        purposes = list(cfg_kv_collect_func(req)) if cfg_kv_collect_func is not None else []
        if KV in purposes or len(set(purposes)) != len(purposes):
            raise ConfigError(f"cfg_kv_collect_func returned invalid purposes {purposes!r}")
        data, nbytes = self._receive(rid, KV, target_device, sender_info, deadline)
        companions = {}
        for purpose in purposes:
            companions[purpose], n = self._receive(rid, purpose, target_device, sender_info, deadline)
            nbytes += n
        return ReceivedKV(rid, data, companions, nbytes)

    def receive_multi_kv_cache(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[[Any], Iterable[str]] | None = None,
        target_device: Any = None,
        *,
        sender_info: Mapping[str, Any] | None = None,
    ) -> bool:
        """Receive the primary KV and the CFG companions ``cfg_kv_collect_func(req)`` names.

        Returns False only when this stage does not receive KV; raises like
        :meth:`receive_kv_cache_for_request` otherwise.
        """
        if not self.config.need_recv_cache:
            return False
        rid = _request_id(req)
        try:
            rec = self._receive_multi(rid, cfg_kv_collect_func, req, target_device, sender_info)
        except _Consumed as exc:
            raise TransferCorrupt(f"KV of {rid} arrived but is unusable: {exc.cause}") from exc.cause
        self._store(req, rec)
        return True

    def _store(self, req: Any, rec: ReceivedKV) -> None:
        with self._lock:
            self._received[rec.request_id] = rec
        _attach(req, rec)

    def pop_received(self, request_id: str) -> ReceivedKV | None:
        """Take (and forget) what was received for ``request_id``."""
        with self._lock:
            return self._received.pop(request_id, None)

    # -- distribution (LEADER -> FOLLOWERs) --------------------------------------------
    def role(self) -> str:
        """``"local"``, ``"leader"`` or ``"follower"`` for this rank."""
        if self.config.distribution == "local":
            return "local"
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return "local"
        if dist.get_world_size(self.process_group) == 1:
            return "local"
        return "leader" if dist.get_rank(self.process_group) == 0 else "follower"

    def _dist(self) -> tuple[Any, int, torch.device]:
        import torch.distributed as dist

        group = self.process_group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        backend = dist.get_backend(group)
        device = (
            torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        )
        return dist, src, device

    def _broadcast_failure(self) -> None:
        dist, src, device = self._dist()
        dist.broadcast(torch.tensor([-1], dtype=torch.int64, device=device), src, group=self.process_group)

    def distribute_kv_cache(self, req: Any, target_device: Any = None, *, received: bool = False) -> bool:
        """Share a received KV over the stage's process group (no-op for ``local``).

        LEADER (``received`` must be True, data from a receive on this rank): broadcasts
        the count, sizes and one packed uint8 tensor per cache. FOLLOWER: receives them and
        attaches the result to ``req``. Raises :class:`TransferError` on followers when the
        leader failed to receive.
        """
        role = self.role()
        if role == "local":
            return received
        rid = _request_id(req)
        dist, src, device = self._dist()
        group = self.process_group
        if role == "leader":
            with self._lock:
                rec = self._received.get(rid)
            if not received or rec is None:
                self._broadcast_failure()
                raise TransferError(f"leader has no received KV for {rid} to distribute")
            items = [rec.data, *rec.companions.values()]
            packed = [d.to_gpu_tensor(device) for d in items]
            dist.broadcast(torch.tensor([len(packed)], dtype=torch.int64, device=device), src, group=group)
            sizes = torch.tensor([p.numel() for p in packed], dtype=torch.int64, device=device)
            dist.broadcast(sizes, src, group=group)
            for p in packed:
                dist.broadcast(p, src, group=group)
            return True
        count = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(count, src, group=group)
        n = int(count.item())
        if n < 0:
            raise TransferError(f"the leader rank failed to receive the KV of {rid}")
        sizes = torch.zeros(n, dtype=torch.int64, device=device)
        dist.broadcast(sizes, src, group=group)
        items = []
        for size in sizes.tolist():
            buf = torch.empty(int(size), dtype=torch.uint8, device=device)
            dist.broadcast(buf, src, group=group)
            data = KVCacheTransferData.from_bytes_device(buf, expected_request_id=rid)
            if target_device is not None:
                data = _to_device(data, target_device)
            items.append(data)
        companions = {str(d.metadata.get("purpose")): d for d in items[1:]}
        self._store(req, ReceivedKV(rid, items[0], companions, sum(d.nbytes for d in items)))
        return True

    def receive_multi_kv_cache_distributed(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[[Any], Iterable[str]] | None = None,
        target_device: Any = None,
        *,
        sender_info: Mapping[str, Any] | None = None,
    ) -> bool:
        """LEADER receives (:meth:`receive_multi_kv_cache`) then distributes; FOLLOWERs get
        it from the leader; ``local`` ranks just receive. A leader failure is propagated to
        the followers (they raise :class:`TransferError`) before it is re-raised."""
        role = self.role()
        if role == "follower":
            return self.distribute_kv_cache(req, target_device, received=False)
        if role == "local":
            return self.receive_multi_kv_cache(
                req, cfg_kv_collect_func, target_device, sender_info=sender_info
            )
        try:
            self.receive_multi_kv_cache(req, cfg_kv_collect_func, target_device, sender_info=sender_info)
        except BaseException:
            self._broadcast_failure()
            raise
        return self.distribute_kv_cache(req, target_device, received=True)

    # -- prefetch ----------------------------------------------------------------------
    def start_prefetch(
        self,
        jobs: Iterable[Any],
        target_device: Any = None,
        cfg_kv_collect_func: Callable[[Any], Iterable[str]] | None = None,
    ) -> list[str]:
        """Start background receives for ``jobs`` (requests, ids, or ``(id, sender_info)``).

        Returns the ids started. Nothing starts when prefetch is disabled, on FOLLOWER
        ranks, or while the target device has less than ``kv_prefetch_min_free_mem_ratio``
        of its memory free (those requests are received synchronously on consume).
        """
        cfg = self.config
        if not (cfg.enable_kv_async_prefetch and cfg.need_recv_cache) or self.role() == "follower":
            return []
        if self._closed:
            raise TransferError("KV transfer manager is shut down")
        device = torch.device(target_device) if target_device is not None else torch.device("cpu")
        if _free_memory_ratio(device) < cfg.kv_prefetch_min_free_mem_ratio:
            logger.warning(
                "KV prefetch skipped: less than %.0f%% of %s memory free",
                100 * cfg.kv_prefetch_min_free_mem_ratio,
                device,
            )
            return []
        started = []
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    cfg.max_prefetch_inflight, thread_name_prefix="kvbridge-prefetch"
                )
            for job in jobs:
                req, info = job if isinstance(job, tuple) else (job, None)
                rid = _request_id(req)
                if rid in self._prefetch:
                    continue
                self._prefetch[rid] = self._executor.submit(
                    self._receive_multi, rid, cfg_kv_collect_func, req, target_device, info
                )
                started.append(rid)
        return started

    def prefetch_in_flight(self) -> int:
        with self._lock:
            return sum(1 for f in self._prefetch.values() if not f.done())

    def consume_and_distribute_kv_cache(
        self,
        req: Any,
        cfg_kv_collect_func: Callable[[Any], Iterable[str]] | None = None,
        target_device: Any = None,
        *,
        sender_info: Mapping[str, Any] | None = None,
    ) -> bool:
        """Use the prefetched KV of ``req`` (then distribute it), or receive synchronously.

        Miss or recoverable prefetch failure: synchronous receive (which may itself raise
        :class:`TransferTimeout`). Payload consumed but unusable: :class:`KVPrefetchConsumeError`.
        """
        rid = _request_id(req)
        with self._lock:
            future = self._prefetch.pop(rid, None)
        role = self.role()
        if future is not None and role != "follower":
            rec = None
            try:
                rec = future.result()
            except _Consumed as exc:
                if role == "leader":
                    self._broadcast_failure()
                raise KVPrefetchConsumeError(
                    f"prefetched KV of {rid} was consumed but unusable: {exc.cause}"
                ) from exc.cause
            except (KVBridgeError, OSError) as exc:
                logger.info("KV prefetch of %s failed (%s); receiving synchronously", rid, exc)
            if rec is not None:
                try:
                    self._store(req, rec)
                    if role == "leader":
                        return self.distribute_kv_cache(req, target_device, received=True)
                    return True
                except Exception as exc:
                    raise KVPrefetchConsumeError(
                        f"post-processing of prefetched KV of {rid} failed: {exc}"
                    ) from exc
        return self.receive_multi_kv_cache_distributed(
            req, cfg_kv_collect_func, target_device, sender_info=sender_info
        )

    # -- lifecycle ---------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        conn = self._connector
        with self._lock:
            state = {
                "pending_sends": len(self._pending_sends),
                "prefetch_in_flight": sum(1 for f in self._prefetch.values() if not f.done()),
                "received_waiting": len(self._received),
                "sender_info_entries": len(self._sent_info),
                "closed": self._closed,
            }
        return {**state, "metrics": self.metrics.health(), "connector": conn.health() if conn else None}

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel prefetches, fail queued sends, join the threads, close the connector. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            io_thread, executor = self._io_thread, self._executor
            futures = list(self._prefetch.values())
            self._prefetch.clear()
        self._stop.set()
        for f in futures:
            f.cancel()
        if io_thread is not None:
            self._queue.put(None)
            io_thread.join(timeout)
        while True:  # jobs never started: report them failed, never done
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                with self._lock:
                    self._pending_sends.discard(job.engine_id)
                    self._failed[job.engine_id] = "manager shut down"
                self.metrics.failure("send")
                self.metrics.transfer_ended("send")
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._parts.clear()
            conn, self._connector = self._connector, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> KVTransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
