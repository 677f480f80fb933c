"""``WorkerKVSender``: the KV send state of one worker, owned by the KV connector.

vLLM's split, kept here: a KV connector's worker half owns its transfer state and any
runner feeds it. vLLM's V1 runner (GPU and CPU) and V2 runner all hand the connector
their paged caches through ``register_kv_caches`` and call ``wait_for_save`` after each
forward, so :class:`~vllm_kvbridge.runner.vllm_connector.KVBridgeConnector` builds one
:class:`WorkerKVSender` from the registered caches and gathers through it; no model-runner
hook is involved and a stock vLLM worker sends KV.

Contract
--------
* :meth:`send` runs on the thread that calls ``wait_for_save`` (vLLM's model thread),
  while the scheduler still holds the blocks: it *gathers* (copies the blocks out of the
  cache) and queues the puts for the KV manager's I/O thread. It never raises: a request
  whose gather or put fails reads ``failed: <why>`` in :meth:`status`.
* Backpressure: while the gathered KV still waiting for its puts is at
  ``max_send_queue_bytes`` or more (its edge is full, or slower than the engine), the sends
  whose blocks the scheduler holds for us (``release``: a finished request's) are *held*:
  not gathered, their blocks not given back, so the KV stays in the engine's cache and the
  engine admits only what its cache holds. At each step every held send is tried on its
  own, oldest first: gathered while the queue has room and it fits, otherwise kept, and
  failed (its blocks go back) once ``send_timeout`` passed since it was held, whatever the
  sends before it do. On
  the staged path (``staging_bytes``; the default on GPU) a held send also stays held while
  the staging pool has no room (``staging.full`` counts it), and its blocks go back only
  once the copy that reads them completed (:meth:`KVTransferManager.copies_in_flight`). A
  send of a request that keeps running (``prefill_finished``, ``special_token``) is
  gathered at once in every case: vLLM frees a running request's blocks without asking
  the connector when it finishes. :meth:`take_released` names the requests whose blocks
  may go back (gathered, failed or withdrawn).
* One deadline per request: its ``send_timeout`` runs from the step that handed it in
  (held or not) and bounds its hold and its put's wait for room alike. Its puts wait for
  room side by side with the other requests' (:mod:`vllm_kvbridge.kv.send_queue`), so
  with the edge full every request fails about ``send_timeout`` after its own start, not
  after the ones before it (issue 36).
* :meth:`status`, :meth:`sender_info` and :meth:`discard` are the worker RPCs' answers;
  they run on the worker's RPC thread, concurrently with :meth:`send`.
* Status per transfer id: ``pending`` | ``done`` | ``failed: why``, and ``aborted``. A
  request's line outlives it in a bounded history
  (:class:`~vllm_kvbridge.runner.transfer_status.StatusHistory`), so the orchestrator can
  ask after the fact; an id never sent reads ``unknown``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvbridge.kv.compat import KV_SPEC_KEY, kv_spec
from vllm_kvbridge.kv.layout import KVCacheLayout
from vllm_kvbridge.kv.paged import BlockTable
from vllm_kvbridge.runner.exit_hook import ExitHook
from vllm_kvbridge.runner.outcomes import TransferOutcome, pusher
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.transfer_status import (
    DONE,
    FAILED,
    PENDING,
    UNKNOWN,
    StatusHistory,
    TransferStatus,
    parse_status,
)

logger = logging.getLogger(__name__)

#: Pause of an engine step that ran nothing while sends are held (no busy loop).
HELD_IDLE_PAUSE_S = 0.01


@dataclass
class _SendState:
    """One request's KV send, from its gather until its status is read from the history."""

    transfer_id: str
    kv: str = PENDING
    aborted: bool = False


@dataclass
class _Held:
    """A send held in the engine's blocks: since when, and why it was not gathered last."""

    spec: Any
    since: float
    #: the gather found no room (staging pool / connector memory), not a full send queue
    deferred: bool = False


class WorkerKVSender:
    """Gathers KV from one worker's paged caches and sends it (see the module docstring).

    ``layout`` is the caches' layout (None: inferred from the tensors, for the CPU layout
    only); ``block_size`` the scheduler's block size (of the ids in the specs);
    ``wrap_transport`` wraps the transport the puts go through (``Connector -> Connector``);
    ``layer_groups`` names each cache's KV cache group (vLLM's order; None: one group),
    whose block table and window a spec carries (:mod:`vllm_kvbridge.kv.paged`).
    """

    def __init__(
        self,
        settings: RunnerSettings,
        kv_caches: Sequence[torch.Tensor],
        layout: KVCacheLayout | None,
        *,
        num_kv_heads: int,
        block_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
        wrap_transport: Any = None,
        model: str | None = None,
        layer_groups: Sequence[int] | None = None,
    ) -> None:
        from vllm_kvbridge.connectors.registry import create_connector
        from vllm_kvbridge.kv.manager import KVTransferManager

        self.settings = settings
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.block_size = block_size
        self.layer_groups = list(layer_groups) if layer_groups is not None else None
        self.tp_rank, self.tp_size = tp_rank, tp_size
        config = settings.kv_transfer_config()
        self._queue_budget, self._send_timeout = config.max_send_queue_bytes, config.send_timeout
        connector = None
        if wrap_transport is not None:
            inner = create_connector(config.connector, config.connector_config, rank=tp_rank)
            connector = wrap_transport(inner)
        self.manager = KVTransferManager(
            config,
            num_kv_heads=num_kv_heads,
            tp_rank=tp_rank,
            layout=layout,
            process_group=tp_group,
            connector=connector,
        )
        # Set up now: a broken transport fails the start.
        device_resident = bool(getattr(self.manager.connector, "device_resident", False))
        stager = self.manager.staging(self.kv_caches[0]) if self.kv_caches else None
        if stager is not None and not device_resident:
            # Pin the staging pool now, in the background (GiBs on a GPU), so no request waits
            # for it; a connector that lends device memory never needs the pool.
            stager.prepare()
        head_dim = layout.head_size if layout is not None else self.kv_caches[0].shape[-1] // 2
        #: what every put declares (the receiver checks it: kv/compat.py)
        self.kv_spec = kv_spec(
            model=model,
            dtype=self.kv_caches[0].dtype,
            num_layers=len(self.kv_caches),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        self._lock = threading.Lock()
        self._live: dict[str, _SendState] = {}  # engine id -> state, until the send settled
        self._history = StatusHistory()  # transfer id -> terminal line
        self._held: deque[_Held] = deque()  # oldest first
        self._released: set[str] = set()  # engine ids whose blocks may go back
        self._copying: set[str] = set()  # gathered on the copy stream, blocks still read
        self._closed = False
        #: (transfer id, status, aborted) settled since the last report (runner/outcomes.py)
        self._settled: list[tuple[str, str, bool]] = []
        self._outcomes = pusher()
        # Sends settle on the KV manager's I/O threads, often after the engine went idle:
        # each reports itself from there, so nobody polls for it.
        self.manager.sends.on_settled = self.poll
        self._exit_hook = ExitHook(self.shutdown)

    # -- model thread ------------------------------------------------------------------------
    def send(self, specs: Sequence[Any], *, idle: bool = False) -> None:
        """Gather and queue the puts of ``specs`` (``KVSendSpec`` items) and of the sends
        held at earlier steps, as far as the send queue's budget allows; never raises.
        ``idle``: this step ran no forward (a held send then pauses the loop a little)."""
        now = time.monotonic()
        at_once = []
        with self._lock:
            for spec in specs:
                self._live[spec.req_id] = _SendState(spec.transfer_id)
                if spec.release:
                    self._held.append(_Held(spec, now))
                else:
                    at_once.append(spec)
        for spec in specs:  # started: the stage now waits for it however long it takes
            self._outcomes.push(TransferOutcome(spec.transfer_id, self.tp_rank, "kv", PENDING))
        self._gather(at_once, now)
        self._drain_held(now)
        self.poll()
        if idle and (self.held() or self.copying()):
            time.sleep(HELD_IDLE_PAUSE_S)

    def _drain_held(self, now: float) -> None:
        """Try every held send once, oldest first, each on its own: gathered while the send
        queue has room and the gather finds room, else kept; failed once held for
        ``send_timeout``. One that cannot go never stops the ones after it."""
        i = 0
        while True:
            with self._lock:
                if i >= len(self._held):
                    return
                held = self._held[i]
                queued = self.manager.queued_send_bytes()
                if queued >= self._queue_budget:
                    held.deferred = False  # kept by the full queue this time
                    if now - held.since >= self._send_timeout:
                        del self._held[i]
                        self._expire_locked(held, now, queued)
                    else:
                        i += 1
                    continue
                del self._held[i]  # out while it is gathered (a discard meanwhile finds nothing)
            if not self._gather([held.spec], held.since):
                with self._lock:
                    self._copying.add(held.spec.req_id)
                continue
            # No room in the staging pool or the connector's memory: keep holding it.
            with self._lock:
                held.deferred = True
                if now - held.since < self._send_timeout:
                    self._held.insert(i, held)
                    i += 1
                else:
                    self._expire_locked(held, now, queued)

    def _expire_locked(self, held: _Held, now: float, queued: int) -> None:
        """``held`` was held for ``send_timeout``: it fails naming what kept it."""
        if held.deferred:
            where = (
                "there was no room for it in the staging pool or the connector's memory "
                f"({self.manager.staging_stats()})"
            )
        else:
            where = (
                f"{queued} bytes waited for their puts (max_send_queue_bytes={self._queue_budget}): "
                "the edge stayed full"
            )
        why = f"KV held {now - held.since:.1f} s in the engine (send_timeout {self._send_timeout:g} s) while "
        self._drop_held_locked(held.spec, why + where)

    def _drop_held_locked(self, spec: Any, why: str) -> None:
        """A held send that will never be gathered: it fails with ``why``, its blocks go back."""
        self._settle(spec.req_id, f"{FAILED}: {why}")
        self._released.add(spec.req_id)

    def _gather(self, specs: Sequence[Any], since: float) -> list[str]:
        """Gather ``specs`` (handed in at ``since``: their puts wait for room until
        ``since + send_timeout``); returns the ids the staging pool had no room for (held ones)."""
        deferred: list[str] = []
        if not specs:
            return deferred
        finished_reqs: dict[str, dict[str, Any]] = {}
        for spec in specs:
            starts = spec.starts or (0,) * len(spec.block_ids)
            info: dict[str, Any] = {
                "block_tables": [
                    BlockTable(ids, start) for ids, start in zip(spec.block_ids, starts, strict=True)
                ],
                "layer_tables": self.layer_groups,
                "seq_len": int(spec.num_tokens),
                "metadata": {KV_SPEC_KEY: self.kv_spec},
                # we give these blocks back only once their copy completed (take_released)
                "blocks_held": bool(spec.release),
            }
            if spec.companion_of:
                info["purpose"] = spec.purpose or "kv"
                info["companion_of"] = spec.companion_of
            finished_reqs[spec.req_id] = info
        ids = {s.req_id: s.transfer_id for s in specs}
        try:
            with self.manager.sends.deadlines({rid: since + self._send_timeout for rid in ids}):
                self.manager.handle_finished_requests_kv_transfer(
                    finished_reqs,
                    self.kv_caches,
                    self.block_size,
                    self.kv_caches[0].dtype,
                    request_id_resolver=ids.__getitem__,
                    deferred=deferred,
                )
        except Exception as exc:
            logger.exception("kvbridge: KV sends of this step could not start")
            why = f"{FAILED}: KV send could not start: {type(exc).__name__}: {exc}"
            with self._lock:
                for spec in specs:
                    self._settle(spec.req_id, why)
        return deferred

    def held(self) -> int:
        """Sends held in the engine's blocks until the send queue has room."""
        with self._lock:
            return len(self._held)

    def take_released(self) -> set[str]:
        """Engine ids whose blocks may go back to vLLM since the last call (each once): held
        sends gathered and no longer read by a copy, failed, or withdrawn."""
        with self._lock:
            copying = set(self._copying)
        if copying:
            still = self.manager.copies_in_flight(copying)
            with self._lock:
                self._copying -= copying - still
                self._released |= copying - still
        with self._lock:
            released, self._released = self._released, set()
        return released

    def copying(self) -> int:
        """Held sends gathered whose copy still reads their blocks."""
        with self._lock:
            return len(self._copying)

    def mark_aborted(self, aborted: Mapping[str, str]) -> None:
        """The requests (engine id -> transfer id) were aborted in the engine: their status
        lines say so, whether their send is still under way or already settled."""
        with self._lock:
            for engine_id, transfer_id in aborted.items():
                state = self._live.get(engine_id)
                if state is not None:
                    state.aborted = True
                else:
                    self._history.mark(transfer_id, "aborted", "true")

    def poll(self) -> None:
        """Move sends that completed or failed since the last call into the history, and
        report what settled to the stage (:mod:`vllm_kvbridge.runner.outcomes`)."""
        done, failed = self.manager.get_finished()
        if done or failed:
            with self._lock:
                for rid in done:
                    self._settle(rid, DONE)
                for rid in failed:
                    self._settle(rid, f"{FAILED}: {self.manager.send_failure_reason(rid) or 'unknown'}")
        self._report_settled()

    def _settle(self, engine_id: str, kv: str) -> None:
        # Called with the lock held.
        state = self._live.pop(engine_id, None)
        if state is None:
            logger.warning("KV send result for unknown request %s: %s", engine_id, kv)
            return
        self._history.record(state.transfer_id, {"kv": kv, "aborted": str(state.aborted).lower()})
        self._settled.append((state.transfer_id, kv, state.aborted))

    def _report_settled(self) -> None:
        """Push the outcome of every send settled since the last call (no lock held: a done
        send's outcome carries its sender info, which the KV manager answers)."""
        with self._lock:
            settled, self._settled = self._settled, []
        for transfer_id, kv, aborted in settled:
            status, reason = parse_status(kv)
            info = (self.manager.get_sender_info(transfer_id) or {}) if status is TransferStatus.DONE else {}
            self._outcomes.push(
                TransferOutcome(transfer_id, self.tp_rank, "kv", status, reason, aborted, info)
            )

    # -- RPC thread --------------------------------------------------------------------------
    def status(self, request_ids: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        """Per transfer id (or engine id): ``{"kv": pending|done|failed: why|unknown, "aborted": ..}``."""
        self.poll()
        with self._lock:
            live = {s.transfer_id: s for s in self._live.values()}
            live.update(self._live)
            ids = list(request_ids) if request_ids is not None else list(live) + list(self._history)
            out: dict[str, dict[str, str]] = {}
            for rid in ids:
                if rid in live:
                    out[rid] = {"kv": live[rid].kv, "aborted": str(live[rid].aborted).lower()}
                elif (line := self._history.get(rid)) is not None:
                    out[rid] = line
                else:
                    out[rid] = {"kv": UNKNOWN, "aborted": "false"}
            return out

    def sender_info(self, request_ids: Iterable[str]) -> dict[str, Any]:
        """Put metadata of the KV sends of ``request_ids`` that completed (per transfer id)."""
        out: dict[str, Any] = {}
        for rid in request_ids:
            got = self.manager.get_sender_info(rid)
            if got is not None:
                out[rid] = got
        return out

    def discard(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Withdraw the KV of ``request_ids`` (transfer ids) nobody will consume: what is out
        now, and a send in flight or still to start when it completes; keys withdrawn per id.
        A send still held in the engine is dropped before its gather (its blocks go back)."""
        ids = list(request_ids)
        with self._lock:
            wanted = set(ids)
            kept: deque[_Held] = deque()
            for held in self._held:
                if held.spec.transfer_id in wanted:
                    self._drop_held_locked(held.spec, "withdrawn before its KV was gathered")
                else:
                    kept.append(held)
            self._held = kept
        self._report_settled()
        return {rid: self.manager.discard_sent(rid) for rid in ids}

    def pending(self) -> int:
        """Puts queued or in flight on the I/O thread."""
        return self.manager.pending_sends()

    def live(self) -> list[str]:
        """Engine ids whose send has not settled (done or failed) yet."""
        self.poll()
        with self._lock:
            return sorted(self._live)

    # -- lifecycle ---------------------------------------------------------------------------
    def shutdown(self, timeout: float = 3.0) -> None:
        """Stop the I/O thread and close the transport; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._exit_hook.cancel()
        with self._lock:
            for held in self._held:
                self._drop_held_locked(held.spec, "shut down before its KV was gathered")
            self._held.clear()
        self._report_settled()
        try:
            self.manager.shutdown(timeout=timeout)
        except Exception:
            logger.exception("KV manager shutdown failed")


def layer_groups_in_layer_order(kv_caches: Mapping[str, torch.Tensor], groups: Sequence[Any]) -> list[int]:
    """Each layer's KV cache group (index into ``groups``, each with ``.layers``), in the
    order of :func:`kv_caches_in_layer_order`."""
    from vllm.model_executor.models.utils import extract_layer_index

    of_layer = {layer: g for g, group in enumerate(groups) for layer in group.layers}
    layers = sorted({extract_layer_index(name) for name in kv_caches})
    missing = [layer for layer in layers if layer not in of_layer]
    if missing:
        raise RuntimeError(f"layers {missing} are in no KV cache group")
    return [of_layer[layer] for layer in layers]


def kv_caches_in_layer_order(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The registered ``{layer name: cache}`` as a list in model layer order.

    vLLM names attention layers ``model.layers.<i>.self_attn.attn``; the receiver indexes
    layers the same way, so the order is the layer index, never the dict's.
    """
    from vllm.model_executor.models.utils import extract_layer_index

    distinct: dict[int, torch.Tensor] = {}
    for name, cache in kv_caches.items():
        distinct.setdefault(extract_layer_index(name), cache)
    return [distinct[i] for i in sorted(distinct)]


__all__ = ["WorkerKVSender", "kv_caches_in_layer_order", "layer_groups_in_layer_order"]
