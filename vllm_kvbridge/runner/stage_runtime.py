"""``StageRuntime``: the runtime layer's one object (connectors, rank routing, request state).

The runtime mixin (:mod:`vllm_kvbridge.runner.runtime`) delegates to it; the diffusion and
vocoder runners hold one directly (through
:class:`~vllm_kvbridge.runner.payload_flows.StageTransport`). It knows nothing about vLLM:
its owner hands it :class:`RunnerSettings` and its TP position.

Per-request state
-----------------
:attr:`StageRuntime.requests` maps the host's request id to a :class:`RequestState` from
:meth:`~StageRuntime.register` until the request is finished (or aborted, or timed out)
*and* nothing of it is in flight any more; a finished request with a send in flight is kept
(deferred cleanup) and reaped by :meth:`~StageRuntime.reap`, which every step and every
status query runs. What outlives it is one line of terminal status per transfer id in a
bounded history (:meth:`~StageRuntime.transfer_status`), so the orchestrator can ask after
the fact.

The contract with the layer above
---------------------------------
The runtime never calls up into another layer's code: what moves a request's data
registers itself as :class:`RequestFlows` (:meth:`~StageRuntime.add_flows`; the payload
layer's :class:`~vllm_kvbridge.runner.payload_flows.PayloadFlows` does), and the runtime
asks it, through that Protocol only, whether a request is in flight, to finish or release
it, what receivers need to reach it, and to stop first on shutdown.

Rank routing
------------
KV: every TP rank sends the heads it holds (the KV manager's topology decides the keys).
Payloads: the model's final hidden states are replicated across TP ranks, so only TP rank 0
sends (:attr:`~StageRuntime.is_payload_rank`); on receive, rank 0 receives and broadcasts
to the other ranks of the TP group. Endpoints are reported by the sender
(:meth:`~StageRuntime.sender_info`), never recomputed by the receiver.

Shutdown
--------
:meth:`~StageRuntime.shutdown` stops the flows, then releases the KV manager and every
connector (segments, sockets) within :data:`SHUTDOWN_TIMEOUT_S`. In a vLLM worker it runs
on vLLM's own shutdown path (``WorkerProc.shutdown`` -> ``Worker.shutdown``: the kvbridge
worker's ``shutdown``); as a fallback it is registered to run at process exit (``atexit``
and multiprocessing's exit finalizers, which a ``multiprocessing`` child runs before
``os._exit``). vLLM SIGKILLs a worker tree that has not exited ~5 s after SIGTERM, so the
budget is small; what a killed process leaves (shared-memory names carrying its pid) is
removed by :func:`reap_stage_leftovers`, which the scheduler-side connector runs in the
engine-core process once the workers are gone, and which every new runtime runs at start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from vllm_kvbridge.connectors.base import Connector, edge_counters
from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.exit_hook import ExitHook
from vllm_kvbridge.runner.outcomes import TransferOutcome, pusher
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.transfer_status import (
    NONE,
    PENDING,
    StatusHistory,
    failed,
    is_failed,
    merge_status,
    parse_status,
)

logger = logging.getLogger(__name__)

#: Wall-clock budget of :meth:`StageRuntime.shutdown` (vLLM kills a worker ~5 s after
#: asking it to stop).
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


def as_settings(settings: RunnerSettings | Mapping[str, Any] | None) -> RunnerSettings:
    """``settings`` as :class:`RunnerSettings` (a dict is parsed; None is the defaults)."""
    if settings is None or isinstance(settings, Mapping):
        return RunnerSettings.from_dict(dict(settings or {}))
    if not isinstance(settings, RunnerSettings):
        raise ConfigError(f"settings must be RunnerSettings or a dict, got {type(settings).__name__}")
    return settings


class TPPosition(NamedTuple):
    """A rank's place in its stage's TP group (the group: a CPU process group, or None)."""

    rank: int = 0
    size: int = 1
    group: Any = None


#: A stage of one rank (no TP group).
SINGLE_RANK = TPPosition()


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


class RequestFlows(Protocol):
    """What the runtime asks of a layer that moves requests' data (the payload flows).

    Called without the runtime's lock held; each method must be cheap and never block on
    the network except :meth:`close`, which gets what is left of the shutdown budget.
    """

    def finish(self, state: RequestState, *, aborted: bool) -> None:
        """The request ended: flush what is accumulated, or cancel it."""

    def in_flight(self, state: RequestState) -> bool:
        """Whether anything of the request is still being sent (may update ``state.payload``)."""

    def release(self, state: RequestState) -> None:
        """Drop the request's resources (it is being forgotten)."""

    def sender_info(self) -> dict[str, Any]:
        """What receivers need to reach this layer's senders (merged into sender info)."""

    def close(self, left: Callable[[], float]) -> None:
        """Stop every thread, flushing what can be while ``left()`` (seconds of the shutdown
        budget) lasts."""


class KVSenderSource(Protocol):
    """Where the runtime finds the stage's KV sender: the vLLM KV connector's worker side,
    which builds it when vLLM registers its caches (and may rebuild it)."""

    @property
    def kv_sender(self) -> Any: ...


class StageRuntime:
    """A stage rank's connectors, request state and KV manager (see the module docstring)."""

    def __init__(
        self,
        settings: RunnerSettings | Mapping[str, Any] | None,
        tp: TPPosition = SINGLE_RANK,
        kv_manager_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.settings = as_settings(settings)
        if not 0 <= tp.rank < tp.size:
            raise ConfigError(f"tp_rank {tp.rank} out of range for tp_size {tp.size}")
        self.tp_rank, self.tp_size, self.tp_group = tp
        #: extra ``KVTransferManager`` arguments (the diffusion module's KV heads, its group)
        self.kv_manager_options = {
            "tp_rank": tp.rank,
            "process_group": tp.group,
            **(kv_manager_options or {}),
        }
        self.lock = threading.Lock()
        self._reap_lock = threading.Lock()
        #: host request id -> state, until finished and nothing is in flight
        self.requests: dict[str, RequestState] = {}
        #: transfer id -> terminal payload status, the newest STATUS_HISTORY
        self.history = StatusHistory()
        #: "in:<peer>" / "out:<peer>" -> connector
        self.connectors: dict[str, Connector] = {}
        self._flows: list[RequestFlows] = []
        self._outcomes = pusher()
        self._kv_manager: Any = None  # the receiving KVTransferManager, created on first use
        self._kv_source: KVSenderSource | None = None
        self.closed = False
        self._shutdown_started: float | None = None
        try:
            reap_stage_leftovers(self.settings)  # a dead predecessor's segments (a restarted stage)
        except Exception:
            logger.exception("kvbridge: reaping leftovers of dead processes failed")
        # Fallback if the owner never calls shutdown (see "Shutdown" above).
        self._exit_hook = ExitHook(self.shutdown)

    @property
    def is_payload_rank(self) -> bool:
        """Payloads are sent and received by TP rank 0 only (see the module docstring)."""
        return self.tp_rank == 0

    def add_flows(self, flows: RequestFlows) -> None:
        """Register a layer that moves requests' data (see "The contract" above)."""
        self._flows.append(flows)

    # -- connectors ------------------------------------------------------------------------
    def connector(self, role: str, peer: int | str, name: str, config: Mapping[str, Any]) -> Connector:
        """One connector per (direction, peer stage), created on first use, closed on shutdown."""
        key = f"{role}:{peer}"
        with self.lock:
            conn = self.connectors.get(key)
            if conn is None:
                if self.closed:
                    raise ConfigError("kvbridge runtime is shut down")
                conn = create_connector(name, config)
                self.connectors[key] = conn
            return conn

    # -- per-request state -----------------------------------------------------------------
    def register(
        self, request_id: str, transfer_id: str | None = None, *, capture: bool = False
    ) -> RequestState:
        """Start tracking a request (idempotent: returns the existing state)."""
        with self.lock:
            state = self.requests.get(request_id)
            if state is None:
                state = RequestState(request_id, transfer_id or request_id, capture=capture)
                self.requests[request_id] = state
            return state

    def state(self, request_id: str) -> RequestState | None:
        with self.lock:
            return self.requests.get(request_id)

    def set_payload_status(self, state: RequestState, status: str) -> None:
        """Set a request's payload status; a failure is final (never overwritten). The first
        put of a request tells the stage its payload started (runner/outcomes.py)."""
        with self.lock:
            started = state.payload == NONE and status == PENDING
            if not is_failed(state.payload):
                state.payload = status
        if started:
            self._outcomes.push(TransferOutcome(state.transfer_id, self.tp_rank, "payload", PENDING))

    def fail(self, request_id: str, reason: str, *, finished: bool = False, aborted: bool = False) -> None:
        """Fail ``request_id``'s payload (a KV send fails in its ``WorkerKVSender``): its
        status reads ``failed: reason``. ``finished``: the request also ended (its state goes
        once nothing is in flight)."""
        state = self.register(request_id)
        with self.lock:
            if state.capture:
                state.payload = failed(reason)
                state.capture = False
            state.finished = state.finished or finished
            state.aborted = state.aborted or aborted
        if finished:
            self.reap()

    def mark_finished(self, request_id: str, *, aborted: bool = False) -> None:
        """The request ended (finished or aborted): the flows flush or cancel it, and its
        state goes once nothing is in flight."""
        state = self.state(request_id)
        if state is None:
            return
        for flows in self._flows:
            flows.finish(state, aborted=aborted)
        with self.lock:
            state.finished = True
            state.aborted = state.aborted or aborted
        self.reap()

    def reap(self) -> list[str]:
        """Forget finished requests with nothing in flight; returns their ids."""
        # One reap at a time (the model thread, the RPC thread and the senders' I/O threads
        # all reap): the in-flight check settles a request's status and release forgets it
        # at its sender, so a concurrent reap could read a half-released request.
        with self._reap_lock:
            return self._reap_once()

    def _reap_once(self) -> list[str]:
        with self.lock:
            candidates = [s for s in self.requests.values() if s.finished]
        # Outside the lock: the in-flight checks ask the senders, which have their own locks.
        ready = [s for s in candidates if not any(f.in_flight(s) for f in self._flows)]
        reaped = []
        for state in ready:
            for flows in self._flows:
                flows.release(state)
            with self.lock:
                if self.requests.pop(state.request_id, None) is None:
                    continue
                self.history.record(
                    state.transfer_id, {"payload": state.payload, "aborted": str(state.aborted).lower()}
                )
            reaped.append(state)
        if reaped:
            info = self.sender_info()
            payload_info = {"payload": info["payload"]} if "payload" in info else {}
            for state in reaped:
                status, reason = parse_status(state.payload)
                self._outcomes.push(
                    TransferOutcome(
                        state.transfer_id,
                        self.tp_rank,
                        "payload",
                        status,
                        reason,
                        state.aborted,
                        payload_info,
                    )
                )
        return [s.request_id for s in reaped]

    def transfer_status(self, request_ids: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        """Per transfer id (or host id): ``{"kv": none|pending|done|failed: why|unknown,
        "payload": ..., "aborted": "true"|"false"}``; the KV part is the KV sender's."""
        self.reap()
        with self.lock:
            live = {s.transfer_id: s for s in self.requests.values()}
            live.update({s.request_id: s for s in self.requests.values()})
            ids = list(request_ids) if request_ids is not None else list(live) + list(self.history)
            payload: dict[str, dict[str, str]] = {}
            for rid in ids:
                if rid in live:
                    s = live[rid]
                    payload[rid] = {"payload": s.payload, "aborted": str(s.aborted).lower()}
                elif (line := self.history.get(rid)) is not None:
                    payload[rid] = line
        sender = self.kv_sender
        if sender is None:
            return {rid: merge_status({"kv": NONE}, payload.get(rid)) for rid in ids}
        kv = sender.status(ids if request_ids is not None else None)
        return {rid: merge_status(kv.get(rid), payload.get(rid)) for rid in dict.fromkeys(ids + list(kv))}

    # -- KV ----------------------------------------------------------------------------------
    # A KV *sender* is owned by the vLLM KV connector's worker side (it holds the caches vLLM
    # registered there; see runner/kv_sender.py); a runner that sends KV names that side as
    # its source (:meth:`use_kv_sender_of`) so one status / sender-info answer covers both
    # the KV and the payloads. A KV *receiver* (the diffusion runner) uses :attr:`kv_manager`.
    def use_kv_sender_of(self, source: KVSenderSource) -> None:
        """Answer KV status, sender info and discards from ``source.kv_sender``."""
        self._kv_source = source

    @property
    def kv_sender(self) -> Any:
        """The stage's ``WorkerKVSender`` (None when this rank sends no KV)."""
        return self._kv_source.kv_sender if self._kv_source is not None else None

    @property
    def kv_manager(self) -> Any:
        """The stage's receiving ``KVTransferManager`` (created on first use; None when the
        stage receives no KV)."""
        if self.settings.kv_transfer is None:
            return None
        with self.lock:
            if self._kv_manager is None:
                if self.closed:
                    raise ConfigError("kvbridge runtime is shut down")
                from vllm_kvbridge.kv.manager import KVTransferManager

                self._kv_manager = KVTransferManager(
                    self.settings.kv_transfer_config(), **self.kv_manager_options
                )
            return self._kv_manager

    def edge_counters(self) -> dict[str, float]:
        """Expired leases and full answers over every connector of this rank (payload edges,
        the KV sender's and the receiving KV manager's), for the pipeline's metrics."""
        with self.lock:
            connectors = list(self.connectors.values())
            managers = [self._kv_manager, getattr(self.kv_sender, "manager", None)]
        healths = [c.health() for c in connectors]
        healths += [m.health()["connector"] for m in managers if m is not None]
        return edge_counters(healths)

    def discard_kv(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Withdraw the sent KV of ``request_ids`` (transfer ids) that nobody will consume
        (the request failed elsewhere); per id, the number of keys withdrawn."""
        sender = self.kv_sender
        return sender.discard(request_ids) if sender is not None else {}

    def sender_info(self, request_ids: Iterable[str] | None = None) -> dict[str, Any]:
        """What receivers need to reach this rank: put metadata of the KV sends of
        ``request_ids`` and what each flows layer reports (the payload edges)."""
        sender = self.kv_sender
        kv = sender.sender_info(request_ids) if sender is not None and request_ids is not None else {}
        info: dict[str, Any] = {
            "stage_id": self.settings.stage_id,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "kv": kv,
        }
        for flows in self._flows:
            info.update(flows.sender_info())
        return info

    # -- shutdown ----------------------------------------------------------------------------
    def shutdown_left(self) -> float:
        """Seconds left of the shutdown budget (started by the first shutdown call)."""
        if self._shutdown_started is None:
            self._shutdown_started = time.monotonic()
        return max(0.1, SHUTDOWN_TIMEOUT_S - (time.monotonic() - self._shutdown_started))

    def shutdown(self) -> None:
        """Stop the flows, close the KV manager and every connector; idempotent, bounded by
        :data:`SHUTDOWN_TIMEOUT_S` in all."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        start = time.monotonic()
        for flows in self._flows:
            try:
                flows.close(self.shutdown_left)
            except Exception:
                logger.exception("kvbridge: stopping the payload flows failed")
        with self.lock:
            conns = list(self.connectors.values())
            self.connectors.clear()
            manager, self._kv_manager = self._kv_manager, None
        if manager is not None:
            try:
                manager.shutdown(timeout=self.shutdown_left())
            except Exception:
                logger.exception("KV manager shutdown failed")
        for conn in conns:
            try:
                conn.close()
            except Exception:
                logger.exception("closing connector %s failed", conn.name)
        self._exit_hook.cancel()
        logger.info(
            "kvbridge: stage %s rank %d shut down (KV manager: %s, %d connectors) in %.3f s",
            self.settings.stage_id,
            self.tp_rank,
            manager is not None,
            len(conns),
            time.monotonic() - start,
        )


__all__ = [
    "SHUTDOWN_TIMEOUT_S",
    "SINGLE_RANK",
    "KVSenderSource",
    "RequestFlows",
    "RequestState",
    "StageRuntime",
    "TPPosition",
    "as_settings",
    "reap_stage_leftovers",
]
