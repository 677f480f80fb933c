"""``KVTransferManager``: gather a finished request's KV, send it, receive it, prefetch it.

The public API of one stage rank's KV transfer; each job lives in its own module and the
manager wires them together:

* :mod:`~vllm_kvbridge.kv.send` / :mod:`~vllm_kvbridge.kv.send_queue` - gather, then puts side by side;
* :mod:`~vllm_kvbridge.kv.sender_info` - the put metadata a sender hands out and the
  receiver's per-stage lookup of it;
* :mod:`~vllm_kvbridge.kv.receive` - one cache of a request from every sender rank, within
  a deadline, checked and merged;
* :mod:`~vllm_kvbridge.kv.cfg` - the primary KV plus CFG companions through one hook;
* :mod:`~vllm_kvbridge.kv.distribution` - LEADER -> FOLLOWER broadcast in a process group;
* :mod:`~vllm_kvbridge.kv.prefetch` - background receives of requests needed soon.

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
runs on the calling thread, because the caller frees the blocks afterwards (on the staged
path, the default on GPU: queued on a copy stream; see :mod:`~vllm_kvbridge.kv.send`);
the connector's puts run off it, each request against its own deadline, with retries. A
request is reported ``done`` only when every put of it succeeded; otherwise ``failed``
(never both, never silently dropped). Ids in ``get_finished`` are ``finished_reqs``' keys.

Receiver side: :meth:`receive_kv_cache_for_request` waits on a monotonic deadline of
``recv_timeout`` seconds and **raises** :class:`TransferTimeout` when the KV did not come
(``(None, 0)`` only when this stage receives no KV); undecodable or mismatched data raises
:class:`TransferCorrupt`. :meth:`receive_multi_kv_cache` receives the primary KV plus the
CFG companions whose purposes ``cfg_kv_collect_func(req)`` names, attached to ``req`` as
``kv_transfer_data`` / ``cfg_kv_transfer_data`` and kept until :meth:`pop_received`.

TP: :mod:`vllm_kvbridge.kv.topology` decides which sender rank sends which heads to which
receiver rank; keys carry both ranks. ``distribution="leader"`` (the edge's ``to_tp`` is
1): group rank 0 receives everything and broadcasts one packed uint8 tensor per cache to
the other ranks (:meth:`receive_multi_kv_cache_distributed`, :meth:`distribute_kv_cache`).

Prefetch: :meth:`start_prefetch` starts background receives (``max_prefetch_inflight``
at once); :meth:`consume_and_distribute_kv_cache` uses a finished one, and on a miss or a
recoverable failure (nothing consumed) receives synchronously; when a consumed payload's
post-processing failed it raises :class:`KVPrefetchConsumeError` (the data is gone).
Pieces a failed multi-rank receive consumed are kept for the next attempt.
:meth:`shutdown` cancels and joins everything and closes the connector.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.connectors.keys import KV
from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import ConfigError, ReceiveWithdrawn, TransferCorrupt, TransferError
from vllm_kvbridge.kv.cfg import CollectFunc, receive_with_companions
from vllm_kvbridge.kv.config import KVTransferConfig, StageId, vllm_settings
from vllm_kvbridge.kv.distribution import KVDistributor
from vllm_kvbridge.kv.layout import KVCacheLayout
from vllm_kvbridge.kv.leases import LeaseKeeper
from vllm_kvbridge.kv.metrics import KVTransferMetrics
from vllm_kvbridge.kv.prefetch import KVPrefetchConsumeError, KVPrefetcher, free_memory_ratio
from vllm_kvbridge.kv.receive import (
    Consumed,
    KVReceiver,
    ReadLedger,
    ReceivedKV,
    ReceivedStore,
    request_id_of,
)
from vllm_kvbridge.kv.send import Stager, StagingFull, gather_job, layout_for
from vllm_kvbridge.kv.send_queue import KVSendQueue
from vllm_kvbridge.kv.sender_info import SentInfoTable, StageSenderInfo
from vllm_kvbridge.kv.topology import TPTopology
from vllm_kvbridge.wire.kv_format import KVCacheTransferData

logger = logging.getLogger(__name__)

__all__ = ["KVPrefetchConsumeError", "KVTransferManager", "ReceivedKV"]


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
        self._stop = threading.Event()  # set by shutdown: interrupts backoffs and receives
        self._closed = False
        self._sent_info = SentInfoTable(sender_info_ttl_s, max_sender_info)
        self.sends = KVSendQueue(config, self._get_connector, self.metrics, self._sent_info, self._stop)
        self._stager: Stager | None = None  # the staged send path, made at the first send
        self._stage_info = StageSenderInfo()
        self._ledger = ReadLedger()  # read vs. withdrawn receives (withdraw_receive)
        self._receiver = KVReceiver(
            config,
            tp_rank=self.tp_rank,
            num_kv_heads=self.num_kv_heads,
            topology=self.topology,
            connector=self._get_connector,
            metrics=self.metrics,
            sender_info=self._stage_info,
            stop=self._stop,
            withdrawn=self._ledger.is_withdrawn,
        )
        dropped = self.metrics.unconsumed_dropped
        self._received = ReceivedStore(config.max_unconsumed, lambda rid: dropped())
        self._distributor = KVDistributor(config.distribution, process_group)
        self._prefetcher = KVPrefetcher(
            config.max_prefetch_inflight, config.max_unconsumed, lambda rid: dropped()
        )
        self._leases = (
            LeaseKeeper(self._get_connector, config.recv_stages[0], config.stage_id)
            if config.need_recv_cache and config.recv_stages
            else None
        )

    # -- construction ------------------------------------------------------------------
    @classmethod
    def from_vllm_config(cls, vllm_config: Any, model_config: Any = None, **kwargs: Any) -> KVTransferManager:
        """Build from the ``kv_transfer`` dict of the kvbridge settings in vLLM's config
        (:func:`~vllm_kvbridge.kv.config.vllm_settings`); ``num_kv_heads`` from ``model_config``
        (default ``vllm_config.model_config``), ``tp_rank`` from vLLM's TP group if set up."""
        settings, where = vllm_settings(vllm_config)
        section = settings.get("kv_transfer") if isinstance(settings, Mapping) else None
        if section is None:
            raise ConfigError(f"{where}.kv_transfer is missing")
        config = KVTransferConfig.from_dict(section, path=f"{where}.kv_transfer")
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
        import msgspec

        mapping = isinstance(stage_config, Mapping)
        section = stage_config.get("kv_transfer") if mapping else getattr(stage_config, "kv_transfer", None)
        if section is None:
            raise ConfigError("stage config has no kv_transfer section")
        if isinstance(section, KVTransferConfig):
            return cls(section, **kwargs)
        section = dict(section if isinstance(section, Mapping) else msgspec.to_builtins(section))
        stage_id = stage_config.get("stage_id") if mapping else getattr(stage_config, "stage_id", None)
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
                self._connector = create_connector(
                    self.config.connector, self.config.connector_config, rank=self.tp_rank
                )
            return self._connector

    def _get_connector(self) -> Connector:
        return self.connector

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

    # -- sending (kv/send.py) ----------------------------------------------------------
    def _layout_for(
        self, kv_caches: Sequence[torch.Tensor], block_size: int, cache_dtype: Any
    ) -> KVCacheLayout:
        return self.layout if self.layout is not None else layout_for(kv_caches, block_size, cache_dtype)

    def handle_finished_requests_kv_transfer(
        self,
        finished_reqs: Mapping[str, Mapping[str, Any]],
        kv_caches: Sequence[torch.Tensor],
        block_size: int,
        cache_dtype: Any,
        request_id_resolver: Callable[[str], str] | None = None,
        deferred: list[str] | None = None,
    ) -> list[str]:
        """Gather each finished request's KV now and queue its send; return the submitted ids.

        A request whose gather fails (bad block ids, ...) is not submitted and is reported
        in ``get_finished()[1]`` right away. With ``staging_bytes`` (kv/send.py, staged
        path), one whose ``info["blocks_held"]`` finds the staging pool full is appended to
        ``deferred`` instead: its caller keeps the blocks and hands it in again later.
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
        edge = (self.config.stage_id, self.config.to_stage, self._get_connector, self.staging(kv_caches[0]))
        submitted: list[str] = []
        for engine_id, info in finished_reqs.items():
            try:
                rid = request_id_resolver(engine_id) if request_id_resolver else engine_id
                job = gather_job(engine_id, rid, info, kv_caches, layout, topo, routes, *edge)
            except StagingFull:
                (deferred if deferred is not None else []).append(engine_id)
                continue
            except Exception as exc:  # one bad request must not stop the others
                logger.error("KV gather for request %s failed: %s", engine_id, exc)
                self.sends.fail(engine_id, f"gather failed: {exc}")
                continue
            self.sends.submit(job)
            submitted.append(engine_id)
        return submitted

    def staging(self, cache: torch.Tensor) -> Stager | None:  # None: the direct path
        self._stager = self._stager or Stager.create(self.config, cache.device)
        return self._stager

    def copies_in_flight(self, request_ids: set[str]) -> set[str]:
        """Which of ``request_ids`` still have a staged copy reading their blocks."""
        return self.sends.copies_in_flight(request_ids)

    def staging_stats(self) -> dict[str, Any] | None:
        """The staging pool's counters (None: direct path); ``full``: refusals, the backpressure."""
        return self._stager.stats() if self._stager else None

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(done, failed)`` request ids since the last call; each id is reported once."""
        return self.sends.get_finished()

    def send_failure_reason(self, request_id: str) -> str | None:
        """Why the send of ``request_id`` (an id :meth:`get_finished` reported failed) failed."""
        return self.sends.failure_reason(request_id)

    def get_sender_info(self, request_id: str) -> dict[str, Any] | None:
        """The put metadata of a sent request, for the receiver (engine's or transfer id).

        ``{"ranks": ..., "keys": ..., "num_kv_heads": n}``. Kept from the moment the send
        completed until :meth:`forget_sender_info`, for ``sender_info_ttl_s`` seconds at most,
        and only for the newest ``max_sender_info`` ids, so the table cannot grow with the
        number of requests (None once forgotten, as for a request never sent).
        """
        return self._sent_info.get(request_id)

    def forget_sender_info(self, request_id: str) -> bool:
        """Drop a request's sender info (under both of its ids); True if there was any."""
        return self._sent_info.forget(request_id)

    def discard_sent(self, request_id: str) -> int:
        """Withdraw a request's KV nobody will consume (its request failed elsewhere, e.g. a
        CFG companion's send failed, or it was aborted): ``cleanup`` of every key already
        sent, and of every key of a send still in flight (or started later) once it
        completes. Returns the number of keys withdrawn now (0: nothing out yet)."""
        info = self._sent_info.withdraw(request_id)
        keys = list((info or {}).get("keys") or {})
        if keys and self._connector is not None:
            self.sends.withdraw_keys(keys)
        return len(keys)

    def pending_sends(self) -> int:
        return self.sends.pending()

    def queued_send_bytes(self) -> int:
        """Bytes of gathered KV whose puts have not completed (see ``max_send_queue_bytes``)."""
        return self.sends.queued_bytes()

    # -- receiving (kv/receive.py, kv/cfg.py) ------------------------------------------
    def update_sender_info(
        self, sender_info: Mapping[str, Any], sender_stage_id: StageId | None = None
    ) -> None:
        """Remember how to reach a sending stage (format: :mod:`~vllm_kvbridge.kv.sender_info`)."""
        stage = sender_stage_id if sender_stage_id is not None else (self.recv_stages or [None])[0]
        self._stage_info.update(stage, sender_info)

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
            got = self._receiver.receive(request_id, purpose, target_device, sender_info, deadline)
            self._ledger.commit(request_id)  # read (see withdraw_receive)
            return got
        except Consumed as exc:
            raise TransferCorrupt(f"KV of {request_id} arrived but is unusable: {exc.cause}") from exc.cause

    def _receive_multi(
        self,
        rid: str,
        cfg_kv_collect_func: CollectFunc | None,
        req: Any,
        target_device: Any,
        sender_info: Mapping[str, Any] | None,
    ) -> ReceivedKV:
        timeout = self.config.recv_timeout
        if self._ledger.is_withdrawn(rid):
            raise ReceiveWithdrawn(f"receive of the KV of {rid} was withdrawn: its producer was lost")
        rec = receive_with_companions(
            self._receiver, timeout, rid, cfg_kv_collect_func, req, target_device, sender_info
        )
        self._ledger.commit(rid)  # read now, unless withdrawn meanwhile (then it raises)
        return rec

    def withdraw_receive(self, request_id: str) -> bool:
        """Give up ``request_id``'s KV unless it was read already (its producer was lost with
        the data). True: withdrawn; a receive of it stops within a get slice and raises
        :class:`ReceiveWithdrawn`, its prefetch and leases are dropped. False: it was read
        (received, by a prefetch too) and stays usable. Either answer is final."""
        if not self._ledger.withdraw(request_id):
            return False
        future = self._prefetcher.pop(request_id)
        if future is not None:
            future.cancel()  # a running one sees the withdrawal between slices
        self.release_leases(request_id)
        return True

    def forget_receive(self, request_id: str) -> None:
        """``request_id`` left this stage: forget whether it was read or withdrawn."""
        self._ledger.forget(request_id)

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
        rid = request_id_of(req)
        try:
            rec = self._receive_multi(rid, cfg_kv_collect_func, req, target_device, sender_info)
        except Consumed as exc:
            raise TransferCorrupt(f"KV of {rid} arrived but is unusable: {exc.cause}") from exc.cause
        self._received.put(req, rec)
        return True

    def pop_received(self, request_id: str) -> ReceivedKV | None:
        """Take (and forget) what was received for ``request_id``."""
        return self._received.pop(request_id)

    # -- distribution (kv/distribution.py) ---------------------------------------------
    def role(self) -> str:
        """``"local"``, ``"leader"`` or ``"follower"`` for this rank."""
        return self._distributor.role()

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
        rid = request_id_of(req)
        if role == "leader":
            rec = self._received.get(rid)
            if not received or rec is None:
                self._distributor.broadcast_failure()
                raise TransferError(f"leader has no received KV for {rid} to distribute")
            self._distributor.send(rec)
            return True
        self._received.put(req, self._distributor.receive(rid, target_device))
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
            self._distributor.broadcast_failure()
            raise
        return self.distribute_kv_cache(req, target_device, received=True)

    # -- prefetch (kv/prefetch.py) -----------------------------------------------------
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
        if free_memory_ratio(device) < cfg.kv_prefetch_min_free_mem_ratio:
            logger.warning(
                "KV prefetch skipped: less than %.0f%% of %s memory free",
                100 * cfg.kv_prefetch_min_free_mem_ratio,
                device,
            )
            return []

        def receive(rid: str, req: Any, info: Any) -> ReceivedKV:
            return self._receive_multi(rid, cfg_kv_collect_func, req, target_device, info)

        return self._prefetcher.start(jobs, receive)

    @property
    def prefetcher(self) -> KVPrefetcher:
        """Its prefetches (``in_flight``; ``ready``/``when_done``: :mod:`~vllm_kvbridge.runner.kv_ready`)."""
        return self._prefetcher

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
        rid = request_id_of(req)
        future = self._prefetcher.pop(rid)
        role = self.role()
        if future is not None and role != "follower":
            on_consumed = self._distributor.broadcast_failure if role == "leader" else None
            rec = self._prefetcher.take(rid, future, on_consumed)
            if rec is not None:
                try:
                    self._received.put(req, rec)
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

    # -- leases ------------------------------------------------------------------------
    def hold_leases(self, request_id: str, sender_info: Mapping[str, Any] | None) -> int:
        """While ``request_id`` waits in this stage, renew at its senders every key its
        producer announced (:mod:`vllm_kvbridge.kv.leases`); how many keys."""
        if self._leases is None or self._closed:
            return 0
        return self._leases.hold(request_id, sender_info)

    def release_leases(self, request_id: str) -> None:
        """``request_id`` no longer waits (it is being received, or was dropped)."""
        if self._leases is not None:
            self._leases.release(request_id)

    # -- lifecycle ---------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        conn = self._connector
        state = {
            "pending_sends": self.sends.pending(),
            "prefetch_in_flight": self._prefetcher.in_flight(),
            "received_waiting": len(self._received),
            "parts_waiting": self._receiver.waiting_parts(),
            "prefetched": len(self._prefetcher),
            "sender_info_entries": len(self._sent_info),
            "leases": self._leases.health() if self._leases is not None else None,
            "staging": self.staging_stats(),
            "closed": self._closed,
        }
        return {**state, "metrics": self.metrics.health(), "connector": conn.health() if conn else None}

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel prefetches, fail queued sends, join the threads, close the connector. Idempotent."""
        with self._connector_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()  # queued prefetches are cancelled, running ones see the flag
        if self._leases is not None:
            self._leases.close()
        self._prefetcher.shutdown()
        self.sends.shutdown(timeout)
        if self._stager:
            self._stager.close()
        self._receiver.clear()
        with self._connector_lock:
            conn, self._connector = self._connector, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> KVTransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
