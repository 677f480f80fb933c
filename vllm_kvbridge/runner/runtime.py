"""``_ConnectorRuntimeMixin``: connectors, rank routing, per-request state, KV delegation.

The lowest of the three runner layers (runtime <- payload transport <- facade). It knows
nothing about vLLM: the host runner hands it :class:`RunnerSettings` and its TP position
in :meth:`kvbridge_init`, and answers the host-contract hooks listed in
:mod:`vllm_kvbridge.runner.mixin` (``kvbridge_kv_caches`` etc.) when KV is sent.

Per-request state
-----------------
``self._kvb.requests`` maps the host's request id to a :class:`RequestState` from
:meth:`kvbridge_register_request` until the request is finished (or aborted, or timed out)
*and* nothing of it is in flight any more; a finished request with a send in flight is
kept (deferred cleanup) and reaped by :meth:`kvbridge_reap`, which every step and every
status query runs. What outlives it is one line of terminal status per transfer id in a
bounded history (``kvbridge_transfer_status``), so the orchestrator can ask after the fact.

Rank routing
------------
KV: every TP rank sends the heads it holds (the KV manager's topology decides the keys).
Payloads: the model's final hidden states are replicated across TP ranks, so only TP
rank 0 sends; on receive, rank 0 receives and broadcasts to the other ranks of the TP group
(:func:`~vllm_kvbridge.runner.payload_stream.broadcast_payload`).
Endpoints are reported by the sender (:meth:`kvbridge_sender_info`: per-rank put
metadata, e.g. a ZMQ endpoint), never recomputed by the receiver.

Shutdown
--------
:meth:`kvbridge_shutdown` releases everything (payload threads, KV manager, connectors and
their segments/sockets) within :data:`SHUTDOWN_TIMEOUT_S`. In a vLLM worker it runs on
vLLM's own shutdown path (``WorkerProc.shutdown`` -> ``Worker.shutdown``: the kvbridge
worker's ``shutdown`` and the worker-side ``KVBridgeConnector.shutdown``); as a fallback
it is registered to run at process exit (``atexit`` and multiprocessing's exit
finalizers, which a ``multiprocessing`` child runs before ``os._exit``). vLLM SIGKILLs a
worker tree that has not exited ~5 s after SIGTERM, so the time budget is small; what a
killed process leaves (shared-memory names carrying its pid) is removed by
:func:`reap_stage_leftovers`, which the scheduler-side connector runs in the engine-core
process once the workers are gone (it waits for a worker the executor has just SIGKILLed:
the executor does not), and which every new runtime runs at start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.connectors.base import Connector, edge_counters
from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.exit_hook import ExitHook
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.transfer_status import FAILED, NONE, StatusHistory, merge_status

logger = logging.getLogger(__name__)

#: Wall-clock budget of :meth:`_ConnectorRuntimeMixin.kvbridge_shutdown` (vLLM kills a
#: worker ~5 s after asking it to stop).
SHUTDOWN_TIMEOUT_S = 3.0


def _stage_edges(settings: RunnerSettings) -> list[tuple[Any, Any, str, dict[str, Any]]]:
    """``(from_stage, to_stage, connector name, connector config)`` of every edge of a stage."""
    edges = []
    for edge in settings.payload.outputs:
        edges.append((settings.stage_id, edge.peer_stage, edge.connector, edge.connector_config))
    for edge in settings.payload.inputs:
        edges.append((edge.peer_stage, settings.stage_id, edge.connector, edge.connector_config))
    kv = settings.kv_transfer_config()
    if kv is not None and kv.need_send_cache and kv.to_stage is not None:
        edges.append((kv.stage_id, kv.to_stage, kv.connector, dict(kv.connector_config)))
    if kv is not None and kv.need_recv_cache and kv.recv_stages:
        edges.append((kv.recv_stages[0], kv.stage_id, kv.connector, dict(kv.connector_config)))
    return edges


def reap_stage_leftovers(settings: RunnerSettings | Mapping[str, Any]) -> list[str]:
    """Remove what dead processes left on this stage's edges; return the names.

    The connector layer decides what that is
    (:func:`~vllm_kvbridge.connectors.leftovers.reap_dead_leftovers`): only names whose
    owner process is gone, so it is safe while live processes use the same edges.
    """
    if not isinstance(settings, RunnerSettings):
        settings = RunnerSettings.from_dict(dict(settings))
    from vllm_kvbridge.connectors.leftovers import reap_dead_leftovers

    removed = reap_dead_leftovers(_stage_edges(settings))
    if removed:
        logger.info("kvbridge: removed %d shared-memory names of dead processes: %s", len(removed), removed)
    return removed


@dataclass
class RequestState:
    """What the runner holds for one live request."""

    request_id: str  # the host's (engine's) id
    transfer_id: str  # the id in transfer keys (the orchestrator's)
    capture: bool = False  # payload capture selected for this request
    payload: str = NONE  # none | pending | done | failed[: reason]
    finished: bool = False
    aborted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RuntimeState:
    """The runtime layer's state on a runner: one object, set by ``kvbridge_init``."""

    settings: RunnerSettings
    tp_rank: int
    tp_size: int
    tp_group: Any
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: host request id -> state, until finished and nothing is in flight
    requests: dict[str, RequestState] = field(default_factory=dict)
    #: transfer id -> terminal payload status, the newest STATUS_HISTORY
    history: StatusHistory = field(default_factory=StatusHistory)
    engine_to_transfer: dict[str, str] = field(default_factory=dict)
    #: "in:<peer>" / "out:<peer>" -> connector
    connectors: dict[str, Connector] = field(default_factory=dict)
    kv_manager: Any = None  # the receiving KVTransferManager (diffusion), created on first use
    kv_sender: Any = None  # the KV connector's WorkerKVSender, when the host sends KV
    closed: bool = False
    exit_hook: ExitHook | None = None
    shutdown_started: float | None = None


class _ConnectorRuntimeMixin:
    """Connector lifecycle, rank routing, per-request state and KV-manager delegation."""

    #: This layer's state (None until :meth:`kvbridge_init`).
    _kvb: RuntimeState | None = None

    # -- set-up / tear-down ----------------------------------------------------------------
    def kvbridge_init(
        self,
        settings: RunnerSettings | Mapping[str, Any] | None,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ) -> None:
        """Install the settings; nothing is connected until first used."""
        if settings is None or isinstance(settings, Mapping):
            settings = RunnerSettings.from_dict(settings or {})
        if not isinstance(settings, RunnerSettings):
            raise ConfigError(f"settings must be RunnerSettings or a dict, got {type(settings).__name__}")
        if not 0 <= tp_rank < tp_size:
            raise ConfigError(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
        self._kvb = RuntimeState(settings, tp_rank, tp_size, tp_group)
        try:
            reap_stage_leftovers(settings)  # a dead predecessor's segments (a restarted stage)
        except Exception:
            logger.exception("kvbridge: reaping leftovers of dead processes failed")
        # Fallback if the host never calls kvbridge_shutdown (see "Shutdown" above).
        self._kvb.exit_hook = ExitHook(self.kvbridge_shutdown)

    @property
    def kvbridge_settings(self) -> RunnerSettings:
        self._kvbridge_check_ready()
        return self._kvb.settings

    def _kvbridge_check_ready(self) -> None:
        if not self._kvb is not None:
            raise ConfigError(f"{type(self).__name__}: kvbridge_init() was not called")

    @property
    def kvbridge_is_payload_rank(self) -> bool:
        """Payloads are sent and received by TP rank 0 only (see the module docstring)."""
        return self._kvb.tp_rank == 0

    def _kvbridge_connector(
        self, role: str, peer: int | str, name: str, config: Mapping[str, Any]
    ) -> Connector:
        """One connector per (direction, peer stage), created on first use, closed on shutdown."""
        key = f"{role}:{peer}"
        with self._kvb.lock:
            conn = self._kvb.connectors.get(key)
            if conn is None:
                if self._kvb.closed:
                    raise ConfigError("kvbridge runtime is shut down")
                conn = create_connector(name, config)
                self._kvb.connectors[key] = conn
            return conn

    def kvbridge_shutdown(self) -> None:
        """Close the KV manager and every connector; idempotent.

        The payload layer stops its threads first (extending this); everything is bounded
        by :data:`SHUTDOWN_TIMEOUT_S` in all.
        """
        if not self._kvb is not None:
            return
        with self._kvb.lock:
            if self._kvb.closed:
                return
            self._kvb.closed = True
            conns = list(self._kvb.connectors.values())
            self._kvb.connectors.clear()
            manager, self._kvb.kv_manager = self._kvb.kv_manager, None
        start = time.monotonic()
        if manager is not None:
            try:
                manager.shutdown(timeout=self._kvbridge_shutdown_left())
            except Exception:
                logger.exception("KV manager shutdown failed")
        for conn in conns:
            try:
                conn.close()
            except Exception:
                logger.exception("closing connector %s failed", conn.name)
        if self._kvb.exit_hook is not None:
            self._kvb.exit_hook.cancel()
        logger.info(
            "kvbridge: stage %s rank %d shut down (KV manager: %s, %d connectors) in %.3f s",
            self._kvb.settings.stage_id,
            self._kvb.tp_rank,
            manager is not None,
            len(conns),
            time.monotonic() - start,
        )

    def _kvbridge_shutdown_left(self) -> float:
        """Seconds left of the shutdown budget (started by the first kvbridge_shutdown layer)."""
        started = self._kvb.shutdown_started
        if started is None:
            started = self._kvb.shutdown_started = time.monotonic()
        return max(0.1, SHUTDOWN_TIMEOUT_S - (time.monotonic() - started))

    # -- per-request state -----------------------------------------------------------------
    def kvbridge_register_request(
        self, request_id: str, transfer_id: str | None = None, *, capture: bool = False
    ) -> RequestState:
        """Start tracking a request (idempotent: returns the existing state)."""
        with self._kvb.lock:
            state = self._kvb.requests.get(request_id)
            if state is None:
                state = RequestState(request_id, transfer_id or request_id, capture=capture)
                self._kvb.requests[request_id] = state
                self._kvb.engine_to_transfer[request_id] = state.transfer_id
            return state

    def kvbridge_request_state(self, request_id: str) -> RequestState | None:
        with self._kvb.lock:
            return self._kvb.requests.get(request_id)

    def kvbridge_active_requests(self) -> list[str]:
        with self._kvb.lock:
            return list(self._kvb.requests)

    def kvbridge_fail_request(
        self, request_id: str, what: str, reason: str, *, finished: bool = False, aborted: bool = False
    ) -> None:
        """Fail ``request_id``'s payload (``what`` is ``"payload"``; a KV send fails in its
        ``WorkerKVSender``): its status reads ``failed: reason``. ``finished``: the request
        also ended (its state goes once nothing is in flight)."""
        if what != "payload":
            raise ValueError(f"kvbridge_fail_request fails payloads, not {what!r}")
        state = self.kvbridge_register_request(request_id)
        with self._kvb.lock:
            if state.capture:
                state.payload = f"{FAILED}: {reason}"
                state.capture = False
            state.finished = state.finished or finished
            state.aborted = state.aborted or aborted
        if finished:
            self.kvbridge_reap()

    def kvbridge_mark_finished(self, request_id: str, *, aborted: bool = False) -> None:
        """The request ended (finished or aborted); its state goes once nothing is in flight."""
        with self._kvb.lock:
            state = self._kvb.requests.get(request_id)
            if state is None:
                return
            state.finished = True
            state.aborted = state.aborted or aborted
        self.kvbridge_reap()

    def _kvbridge_in_flight(self, state: RequestState) -> bool:
        """Whether anything of ``state`` is still being sent (payload layer extends this)."""
        return False

    def _kvbridge_release(self, state: RequestState) -> None:
        """Drop a request's resources (payload layer extends this); called without the lock."""

    def kvbridge_reap(self) -> list[str]:
        """Forget finished requests with nothing in flight; returns their ids."""
        with self._kvb.lock:
            candidates = [s for s in self._kvb.requests.values() if s.finished]
        # Outside the lock: the in-flight checks ask the senders, which have their own locks.
        ready = [s for s in candidates if not self._kvbridge_in_flight(s)]
        for state in ready:
            self._kvbridge_release(state)
            with self._kvb.lock:
                self._kvb.requests.pop(state.request_id, None)
                self._kvb.engine_to_transfer.pop(state.request_id, None)
                self._record_history(state)
        return [s.request_id for s in ready]

    def _record_history(self, state: RequestState) -> None:
        # Called with the lock held.
        self._kvb.history.record(
            state.transfer_id, {"payload": state.payload, "aborted": str(state.aborted).lower()}
        )

    def kvbridge_transfer_status(self, request_ids: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        """Per transfer id (or host id): ``{"kv": none|pending|done|failed: why|unknown,
        "payload": ..., "aborted": "true"|"false"}``; the KV part is the attached sender's."""
        self.kvbridge_reap()
        with self._kvb.lock:
            live = {s.transfer_id: s for s in self._kvb.requests.values()}
            live.update({s.request_id: s for s in self._kvb.requests.values()})
            ids = list(request_ids) if request_ids is not None else list(live) + list(self._kvb.history)
            payload: dict[str, dict[str, str]] = {}
            for rid in ids:
                if rid in live:
                    s = live[rid]
                    payload[rid] = {"payload": s.payload, "aborted": str(s.aborted).lower()}
                elif (line := self._kvb.history.get(rid)) is not None:
                    payload[rid] = line
        sender = self.kvbridge_kv_sender
        if sender is None:
            return {rid: merge_status({"kv": NONE}, payload.get(rid)) for rid in ids}
        kv = sender.status(ids if request_ids is not None else None)
        return {rid: merge_status(kv.get(rid), payload.get(rid)) for rid in dict.fromkeys(ids + list(kv))}

    # -- KV ----------------------------------------------------------------------------------
    # A KV *sender* is owned by the vLLM KV connector's worker half (it holds the caches
    # vLLM registered there; see runner/kv_sender.py); a runner that sends KV attaches it
    # (:meth:`kvbridge_attach_kv_sender`) so one status / sender-info answer covers both
    # the KV and the payloads. A KV *receiver* (the diffusion runner) uses
    # :attr:`kvbridge_kv_manager`.
    def kvbridge_attach_kv_sender(self, sender: Any) -> None:
        """Answer KV status, sender info and discards from ``sender`` (a ``WorkerKVSender``)."""
        self._kvb.kv_sender = sender

    @property
    def kvbridge_kv_sender(self) -> Any:
        return self._kvb.kv_sender if self._kvb is not None else None

    @property
    def kvbridge_kv_manager(self) -> Any:
        """The stage's receiving ``KVTransferManager`` (created on first use; None when the
        stage receives no KV)."""
        self._kvbridge_check_ready()
        if self._kvb.settings.kv_transfer is None:
            return None
        with self._kvb.lock:
            if self._kvb.kv_manager is None:
                if self._kvb.closed:
                    raise ConfigError("kvbridge runtime is shut down")
                from vllm_kvbridge.kv.manager import KVTransferManager

                self._kvb.kv_manager = KVTransferManager(
                    self._kvb.settings.kv_transfer_config(), **self.kvbridge_kv_manager_kwargs()
                )
            return self._kvb.kv_manager

    def kvbridge_connect(self) -> None:
        """Create the connectors this stage moves payloads through now, at start-up: the
        model thread then never sets one up mid-serving, and a broken one fails the start
        (the payload layer does it; a KV sender connects when it is built)."""

    def kvbridge_kv_manager_kwargs(self) -> dict[str, Any]:
        """Extra ``KVTransferManager`` arguments (heads, rank, group); hosts override."""
        return {"tp_rank": self._kvb.tp_rank, "process_group": self._kvb.tp_group}

    def kvbridge_edge_counters(self) -> dict[str, float]:
        """Expired leases and full answers over every connector of this rank (payload
        edges, the KV sender's and the receiving KV manager's), for the pipeline's metrics."""
        with self._kvb.lock:
            connectors = list(self._kvb.connectors.values())
            managers = [self._kvb.kv_manager, getattr(self._kvb.kv_sender, "manager", None)]
        healths = [c.health() for c in connectors]
        healths += [m.health()["connector"] for m in managers if m is not None]
        return edge_counters(healths)

    def kvbridge_discard_kv(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Withdraw the sent KV of ``request_ids`` (transfer ids) that nobody will consume
        (the request failed elsewhere); per id, the number of keys withdrawn."""
        sender = self.kvbridge_kv_sender
        return sender.discard(request_ids) if sender is not None else {}

    def kvbridge_sender_info(self, request_ids: Iterable[str] | None = None) -> dict[str, Any]:
        """What receivers need to reach this rank: put metadata of the KV sends of
        ``request_ids`` and of the payload edges (extended by the payload layer)."""
        sender = self.kvbridge_kv_sender
        kv = sender.sender_info(request_ids) if sender is not None and request_ids is not None else {}
        return {
            "stage_id": self._kvb.settings.stage_id,
            "tp_rank": self._kvb.tp_rank,
            "tp_size": self._kvb.tp_size,
            "kv": kv,
        }
