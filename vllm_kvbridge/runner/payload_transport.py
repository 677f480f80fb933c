"""``_PayloadTransportMixin``: the full-payload and async-chunk flows of a runner.

Sender side (output edges of :class:`~vllm_kvbridge.runner.settings.PayloadSettings`):
the host calls :meth:`kvbridge_add_step_output` with a request's outputs of one step
(e.g. ``{"hidden_states": [n, hidden], "token_ids": [k]}``) and
:meth:`kvbridge_mark_finished` when it ends.

* ``full`` edges accumulate every step and put one payload when the request finishes.
* ``async_chunk`` edges put a chunk once the steps since the last one generated
  ``chunk_size`` tokens (the host says how many each step generated: none for a
  chunked-prefill step, several for a multi-token step; the first chunk starts with the
  prefill, so it also carries the prompt's rows), ordered chunk ids, and the rest with the
  finish marker when the request finishes.
* An aborted request: queued puts are dropped and an abort envelope tells the receiver.

``custom_process_next_stage_input_func(payload, request_id=..., final=...)`` turns each
payload or chunk into the next stage's input just before it is put. The puts run on each
edge's :class:`~vllm_kvbridge.runner.payload_stream.PayloadSender` (a few I/O threads,
``SEND_WORKERS``, one request's puts in order on one of them at a time); the model thread
only copies rows and enqueues.

Receiver side (input edges): :meth:`kvbridge_expect_payload` starts the background receive
of a request, :meth:`kvbridge_get_payload` waits for it (rank 0 receives; with TP > 1 it is
broadcast to the other ranks, which must call it in the same order),
:meth:`kvbridge_cancel_payload` stops it. The wire form, the merge rule and the one-lock
ordering contract are those of :mod:`vllm_kvbridge.runner.payload_stream`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.errors import ConfigError, KVBridgeError
from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
from vllm_kvbridge.runner.payload_stream import (
    PayloadAccumulator,
    PayloadSender,
    broadcast_payload,
)
from vllm_kvbridge.runner.runtime import RequestState, _ConnectorRuntimeMixin
from vllm_kvbridge.runner.settings import PayloadEdgeSettings, RunnerSettings
from vllm_kvbridge.runner.transfer_status import DONE, FAILED, PENDING

logger = logging.getLogger(__name__)


@dataclass
class PayloadState:
    """The payload layer's state on a runner: one object, set by ``kvbridge_init``."""

    #: ``custom_process_next_stage_input_func``, loaded
    process: Callable[..., dict[str, Any]] | None = None
    senders: dict[str, PayloadSender] = field(default_factory=dict)  # edge peer -> sender
    receivers: dict[str, PayloadReceiver] = field(default_factory=dict)  # edge peer -> receiver
    #: request id -> edge peer -> accumulator (only on the payload rank)
    acc: dict[str, dict[str, PayloadAccumulator]] = field(default_factory=dict)


class _PayloadTransportMixin(_ConnectorRuntimeMixin):
    """Payload build, full and async-chunk flows, TP fan-out (see the module docstring)."""

    _kvb_payload: PayloadState

    def kvbridge_init(
        self,
        settings: RunnerSettings | Mapping[str, Any] | None,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ) -> None:
        super().kvbridge_init(settings, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        # fail at start-up if the path is wrong
        self._kvb_payload = PayloadState(process=self._kvb.settings.payload.process_func())

    # -- edges -----------------------------------------------------------------------------
    def _kvbridge_sender(self, edge: PayloadEdgeSettings) -> PayloadSender:
        peer = str(edge.peer_stage)
        with self._kvb.lock:
            sender = self._kvb_payload.senders.get(peer)
        if sender is None:
            conn = self._kvbridge_connector("out", edge.peer_stage, edge.connector, edge.connector_config)
            with self._kvb.lock:
                sender = self._kvb_payload.senders.get(peer)
                if sender is None:
                    sender = PayloadSender(
                        conn,
                        self._kvb.settings.stage_id,
                        edge.peer_stage,
                        retries=edge.send_retries,
                        send_timeout_s=edge.send_timeout_s,
                    )
                    self._kvb_payload.senders[peer] = sender
        return sender

    def kvbridge_connect(self) -> None:
        super().kvbridge_connect()
        if self.kvbridge_is_payload_rank:
            for edge in self._kvb.settings.payload.outputs:
                self._kvbridge_sender(edge)

    def _kvbridge_input_edge(self, from_stage: int | str | None) -> PayloadEdgeSettings:
        inputs = self._kvb.settings.payload.inputs
        if not inputs:
            raise ConfigError("this stage has no payload input edges (kvbridge.payload.inputs)")
        if from_stage is None:
            if len(inputs) > 1:
                raise ConfigError(
                    f"several payload inputs ({[e.peer_stage for e in inputs]}): pass from_stage"
                )
            return inputs[0]
        for edge in inputs:
            if str(edge.peer_stage) == str(from_stage):
                return edge
        raise ConfigError(f"no payload input edge from stage {from_stage!r}")

    def kvbridge_payload_receiver(self, from_stage: int | str | None = None) -> PayloadReceiver:
        """The receiver of an input edge (created on first use, rank 0 only)."""
        edge = self._kvbridge_input_edge(from_stage)
        if not self.kvbridge_is_payload_rank:
            raise ConfigError(
                "payloads are received by TP rank 0; other ranks get them via kvbridge_get_payload"
            )
        peer = str(edge.peer_stage)
        with self._kvb.lock:
            receiver = self._kvb_payload.receivers.get(peer)
        if receiver is None:
            conn = self._kvbridge_connector("in", edge.peer_stage, edge.connector, edge.connector_config)
            with self._kvb.lock:
                receiver = self._kvb_payload.receivers.get(peer)
                if receiver is None:
                    receiver = PayloadReceiver(
                        conn,
                        edge.peer_stage,
                        self._kvb.settings.stage_id,
                        mode=edge.mode,
                        recv_timeout_s=edge.recv_timeout_s,
                        stall_timeout_s=edge.stall_timeout_s,
                        replace_keys=self._kvb.settings.payload.replace_keys,
                    )
                    self._kvb_payload.receivers[peer] = receiver
        return receiver

    # -- sender side -------------------------------------------------------------------------
    def kvbridge_add_step_output(
        self, request_id: str, outputs: Mapping[str, Any], *, num_tokens: int = 1
    ) -> None:
        """Add one step's outputs of a captured request; puts a chunk when one is due.

        ``num_tokens``: how many tokens the request generated in this step (0 for a step
        that only advanced a chunked prefill); ``chunk_size`` counts these.
        """
        if not self._kvb.settings.payload.outputs or not self.kvbridge_is_payload_rank:
            return
        state = self.kvbridge_register_request(request_id, capture=True)
        accs = self._kvb_payload.acc.setdefault(request_id, {})
        for edge in self._kvb.settings.payload.outputs:
            peer = str(edge.peer_stage)
            acc = accs.get(peer)
            if acc is None:
                acc = accs[peer] = PayloadAccumulator(self._kvb.settings.payload.replace_keys)
            acc.add(outputs, num_tokens)
            if edge.mode == "async_chunk" and acc.tokens >= edge.chunk_size:
                self._kvbridge_put(state, edge, acc.take(), final=False)

    def kvbridge_fail_capture(self, request_id: str, reason: str) -> None:
        """Stop capturing ``request_id`` and fail its payload with ``reason``.

        The reason becomes the request's payload status (the pipeline fails the request with
        it) and reaches every receiver of the request as an abort, so they fail at once
        instead of at their timeout. Nothing partial is ever put.
        """
        state = self.kvbridge_request_state(request_id)
        if state is None:
            return
        with self._kvb.lock:
            state.capture = False
            state.payload = f"{FAILED}: {reason}"
        logger.error("payload capture of request %s failed: %s", state.transfer_id, reason)
        if not self._kvb.settings.payload.outputs or not self.kvbridge_is_payload_rank:
            return
        self._kvb_payload.acc.pop(request_id, None)
        for edge in self._kvb.settings.payload.outputs:
            self._kvbridge_sender(edge).abort(state.transfer_id, reason, chunked=edge.mode == "async_chunk")

    def _kvbridge_put(
        self, state: RequestState, edge: PayloadEdgeSettings, payload: dict[str, Any], *, final: bool
    ) -> None:
        rid = state.transfer_id
        try:
            if self._kvb_payload.process is not None:
                payload = self._kvb_payload.process(payload, request_id=rid, final=final)
            sender = self._kvbridge_sender(edge)
            if edge.mode == "full":
                sender.send_full(rid, payload)
            else:
                sender.send_chunk(rid, payload if payload else None, final=final)
        except Exception as exc:  # never break the model thread; fail the request instead
            logger.error("payload of request %s to stage %s failed: %s", rid, edge.peer_stage, exc)
            with self._kvb.lock:
                state.payload = f"{FAILED}: {exc}"
            return
        with self._kvb.lock:
            if not state.payload.startswith(FAILED):
                state.payload = PENDING

    def kvbridge_mark_finished(self, request_id: str, *, aborted: bool = False) -> None:
        state = self.kvbridge_request_state(request_id)
        if state is not None and self._kvb.settings.payload.outputs and self.kvbridge_is_payload_rank:
            accs = self._kvb_payload.acc.pop(request_id, {})
            if state.capture:
                for edge in self._kvb.settings.payload.outputs:
                    acc = accs.get(str(edge.peer_stage))
                    if aborted:
                        self._kvbridge_sender(edge).abort(
                            state.transfer_id, chunked=edge.mode == "async_chunk"
                        )
                        with self._kvb.lock:
                            state.payload = PENDING
                    else:
                        self._kvbridge_put(state, edge, acc.take() if acc else {}, final=True)
        super().kvbridge_mark_finished(request_id, aborted=aborted)

    def _kvbridge_payload_status(self, state: RequestState) -> str:
        statuses = []
        for edge in self._kvb.settings.payload.outputs:
            with self._kvb.lock:
                sender = self._kvb_payload.senders.get(str(edge.peer_stage))
            statuses.append(sender.status(state.transfer_id) if sender else None)
        statuses = [s for s in statuses if s is not None]
        if not statuses:
            return state.payload
        failed = [s for s in statuses if s.startswith(FAILED)]
        if failed:
            return failed[0]
        return DONE if all(s == DONE for s in statuses) else PENDING

    def _kvbridge_in_flight(self, state: RequestState) -> bool:
        if super()._kvbridge_in_flight(state):
            return True
        for sender in list(self._kvb_payload.senders.values()):
            if sender.in_flight(state.transfer_id):
                return True
        if state.capture and not state.payload.startswith(FAILED):
            state.payload = self._kvbridge_payload_status(state)
            if state.aborted and state.payload.startswith(FAILED):
                state.payload = "aborted"
        return False

    def _kvbridge_release(self, state: RequestState) -> None:
        self._kvb_payload.acc.pop(state.request_id, None)
        for sender in list(self._kvb_payload.senders.values()):
            if state.transfer_id in sender.tracked():
                sender.forget(state.transfer_id)
        super()._kvbridge_release(state)

    def kvbridge_sender_info(self, request_ids: Any = None) -> dict[str, Any]:
        info = super().kvbridge_sender_info(request_ids)
        with self._kvb.lock:
            senders = dict(self._kvb_payload.senders)
        # Before a sender's first put, what its connector can say up front (a ZMQ endpoint):
        # async-chunk consumers start receiving before the producer put anything. With it,
        # the sender's doorbell, which wakes them when a payload lands.
        info["payload"] = {peer: s.receiver_info() for peer, s in senders.items()}
        return info

    # -- receiver side -----------------------------------------------------------------------
    def kvbridge_expect_payload(
        self,
        request_id: str,
        from_stage: int | str | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Start receiving ``request_id`` in the background (rank 0; a no-op on other ranks)."""
        if self.kvbridge_is_payload_rank:
            self.kvbridge_payload_receiver(from_stage).expect(request_id, metadata=metadata)

    def kvbridge_get_payload(
        self, request_id: str, from_stage: int | str | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Wait for an expected payload; every TP rank gets it (collective when TP > 1)."""
        result: dict[str, Any] | BaseException
        if self.kvbridge_is_payload_rank:
            try:
                result = self.kvbridge_payload_receiver(from_stage).result(request_id, timeout)
            except KVBridgeError as exc:
                result = exc
        else:
            result = {}
        if self._kvb.tp_size > 1:
            if self._kvb.tp_group is None:
                raise ConfigError(
                    "TP > 1 needs a process group (kvbridge_init(tp_group=...)) for payload fan-out"
                )
            return broadcast_payload(result, self._kvb.tp_group, src=0)
        if isinstance(result, BaseException):
            raise result
        return result

    def kvbridge_cancel_payload(self, request_id: str, from_stage: int | str | None = None) -> bool:
        if not self.kvbridge_is_payload_rank:
            return False
        return self.kvbridge_payload_receiver(from_stage).cancel(request_id)

    def kvbridge_shutdown(self) -> None:
        if not self._kvb is not None:
            return
        with self._kvb.lock:
            if self._kvb.closed:
                return
            senders, self._kvb_payload.senders = list(self._kvb_payload.senders.values()), {}
            receivers, self._kvb_payload.receivers = list(self._kvb_payload.receivers.values()), {}
        # Receivers first (they only wait), then senders: queued puts get what is left of
        # the budget, then their connectors are closed under them (the put fails, cleanly).
        for receiver in receivers:
            receiver.close(timeout=self._kvbridge_shutdown_left())
        for sender in senders:
            sender.close(timeout=self._kvbridge_shutdown_left())
        super().kvbridge_shutdown()

    def kvbridge_threads_alive(self) -> int:
        """Background payload threads still running (0 after shutdown); for tests and health."""
        with self._kvb.lock:
            objs = list(self._kvb_payload.senders.values()) + list(self._kvb_payload.receivers.values())
        return sum(o.threads_alive() for o in objs)
