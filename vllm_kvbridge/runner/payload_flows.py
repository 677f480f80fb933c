"""``PayloadFlows``: the payload layer's one object (full-payload and async-chunk flows).

The payload-transport mixin (:mod:`vllm_kvbridge.runner.payload_transport`) delegates to
it; it registers itself with the stage's :class:`~vllm_kvbridge.runner.stage_runtime.StageRuntime`
as its :class:`~vllm_kvbridge.runner.stage_runtime.RequestFlows` (the typed contract
between the two layers), and uses the runtime below it for connectors and request state.

Sender side (output edges of :class:`~vllm_kvbridge.runner.settings.PayloadSettings`): the
host adds a request's outputs of one step (:meth:`PayloadFlows.add_step_output`, e.g.
``{"hidden_states": [n, hidden], "token_ids": [k]}``) and the runtime tells the flows when
it ends (:meth:`PayloadFlows.finish`).

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

Receiver side (input edges): :meth:`PayloadFlows.expect` starts the background receive of a
request, :meth:`PayloadFlows.get` waits for it (rank 0 receives; with TP > 1 it is broadcast
to the other ranks, which must call it in the same order), :meth:`PayloadFlows.cancel` stops
it. The wire form, the merge rule and the one-lock ordering contract are those of
:mod:`vllm_kvbridge.runner.payload_stream`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.errors import ConfigError, KVBridgeError
from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
from vllm_kvbridge.runner.payload_stream import PayloadAccumulator, PayloadSender, broadcast_payload
from vllm_kvbridge.runner.settings import PayloadEdgeSettings, RunnerSettings
from vllm_kvbridge.runner.stage_runtime import SINGLE_RANK, RequestState, StageRuntime, TPPosition
from vllm_kvbridge.runner.transfer_status import DONE, PENDING, TransferStatus, failed, is_failed

logger = logging.getLogger(__name__)


class PayloadFlows:
    """A stage rank's payload senders, receivers and accumulators (see the module docstring)."""

    def __init__(self, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings.payload
        # fail at start-up if the path is wrong
        self._process = self.settings.process_func()
        self._lock = threading.Lock()
        self.senders: dict[str, PayloadSender] = {}  # edge peer -> sender
        self.receivers: dict[str, PayloadReceiver] = {}  # edge peer -> receiver
        #: request id -> edge peer -> accumulator (only on the payload rank)
        self.accumulators: dict[str, dict[str, PayloadAccumulator]] = {}
        runtime.add_flows(self)

    @property
    def _sends(self) -> bool:
        return bool(self.settings.outputs) and self.runtime.is_payload_rank

    # -- edges -----------------------------------------------------------------------------
    def _on_edge(self, table: dict[str, Any], role: str, edge: PayloadEdgeSettings, make: Callable) -> Any:
        """The edge's sender or receiver in ``table``, made from its connector on first use
        (the connector is created outside the lock: it may connect)."""
        peer = str(edge.peer_stage)
        with self._lock:
            found = table.get(peer)
        if found is None:
            conn = self.runtime.connector(role, edge.peer_stage, edge.connector, edge.connector_config)
            with self._lock:
                found = table.get(peer)
                if found is None:
                    found = table[peer] = make(conn)
        return found

    def sender(self, edge: PayloadEdgeSettings) -> PayloadSender:
        """The sender of an output edge (created on first use)."""
        return self._on_edge(
            self.senders,
            "out",
            edge,
            self._new_sender_for(edge),
        )

    def _new_sender_for(self, edge: PayloadEdgeSettings) -> Callable[[Connector], PayloadSender]:
        def make(conn: Connector) -> PayloadSender:
            sender = PayloadSender(
                conn,
                self.runtime.settings.stage_id,
                edge.peer_stage,
                retries=edge.send_retries,
                send_timeout_s=edge.send_timeout_s,
            )
            # A request whose last put settled is reaped (and reported) from the I/O thread.
            sender.on_settled = lambda _request_id: self.runtime.reap()
            return sender

        return make

    def connect(self) -> None:
        """Create the output edges' senders now, at start-up: the model thread then never
        sets one up mid-serving, and a broken connector fails the start."""
        if self.runtime.is_payload_rank:
            for edge in self.settings.outputs:
                self.sender(edge)

    def input_edge(self, from_stage: int | str | None) -> PayloadEdgeSettings:
        inputs = self.settings.inputs
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

    def receiver(self, from_stage: int | str | None = None) -> PayloadReceiver:
        """The receiver of an input edge (created on first use, rank 0 only)."""
        edge = self.input_edge(from_stage)
        if not self.runtime.is_payload_rank:
            raise ConfigError(
                "payloads are received by TP rank 0; other ranks get them via kvbridge_get_payload"
            )
        return self._on_edge(
            self.receivers,
            "in",
            edge,
            lambda conn: PayloadReceiver(
                conn,
                edge.peer_stage,
                self.runtime.settings.stage_id,
                mode=edge.mode,
                recv_timeout_s=edge.recv_timeout_s,
                stall_timeout_s=edge.stall_timeout_s,
                replace_keys=self.settings.replace_keys,
            ),
        )

    # -- sender side -------------------------------------------------------------------------
    def add_step_output(self, request_id: str, outputs: Mapping[str, Any], *, num_tokens: int = 1) -> None:
        """Add one step's outputs of a captured request; puts a chunk when one is due.

        ``num_tokens``: how many tokens the request generated in this step (0 for a step
        that only advanced a chunked prefill); ``chunk_size`` counts these.
        """
        if not self._sends:
            return
        state = self.runtime.register(request_id, capture=True)
        accs = self.accumulators.setdefault(request_id, {})
        for edge in self.settings.outputs:
            peer = str(edge.peer_stage)
            acc = accs.get(peer)
            if acc is None:
                acc = accs[peer] = PayloadAccumulator(self.settings.replace_keys)
            acc.add(outputs, num_tokens)
            if edge.mode == "async_chunk" and acc.tokens >= edge.chunk_size:
                self._put(state, edge, acc.take(), final=False)

    def fail_capture(self, request_id: str, reason: str) -> None:
        """Stop capturing ``request_id`` and fail its payload with ``reason``.

        The reason becomes the request's payload status (the pipeline fails the request with
        it) and reaches every receiver of the request as an abort, so they fail at once
        instead of at their timeout. Nothing partial is ever put.
        """
        state = self.runtime.state(request_id)
        if state is None:
            return
        with self.runtime.lock:
            state.capture = False
            state.payload = failed(reason)
        logger.error("payload capture of request %s failed: %s", state.transfer_id, reason)
        if not self._sends:
            return
        self.accumulators.pop(request_id, None)
        for edge in self.settings.outputs:
            self.sender(edge).abort(state.transfer_id, reason, chunked=edge.mode == "async_chunk")

    def _put(
        self, state: RequestState, edge: PayloadEdgeSettings, payload: dict[str, Any], *, final: bool
    ) -> None:
        rid = state.transfer_id
        try:
            if self._process is not None:
                payload = self._process(payload, request_id=rid, final=final)
            sender = self.sender(edge)
            if edge.mode == "full":
                sender.send_full(rid, payload)
            else:
                sender.send_chunk(rid, payload if payload else None, final=final)
        except Exception as exc:  # never break the model thread; fail the request instead
            logger.error("payload of request %s to stage %s failed: %s", rid, edge.peer_stage, exc)
            with self.runtime.lock:
                state.payload = failed(exc)
            return
        self.runtime.set_payload_status(state, PENDING)

    # -- RequestFlows (the runtime's contract) -------------------------------------------------
    def finish(self, state: RequestState, *, aborted: bool) -> None:
        """Flush the request's accumulated outputs (the final put), or cancel them."""
        if not self._sends:
            return
        accs = self.accumulators.pop(state.request_id, {})
        if not state.capture:
            return
        for edge in self.settings.outputs:
            if aborted:
                self.sender(edge).abort(state.transfer_id, chunked=edge.mode == "async_chunk")
                with self.runtime.lock:
                    state.payload = PENDING
            else:
                acc = accs.get(str(edge.peer_stage))
                self._put(state, edge, acc.take() if acc else {}, final=True)

    def _status(self, state: RequestState) -> str:
        with self._lock:
            senders = [self.senders.get(str(edge.peer_stage)) for edge in self.settings.outputs]
        statuses = [s.status(state.transfer_id) for s in senders if s is not None]
        statuses = [s for s in statuses if s is not None]
        if not statuses:
            return state.payload
        failures = [s for s in statuses if is_failed(s)]
        if failures:
            return failures[0]
        return DONE if all(s == DONE for s in statuses) else PENDING

    def in_flight(self, state: RequestState) -> bool:
        with self._lock:
            senders = list(self.senders.values())
        if any(sender.in_flight(state.transfer_id) for sender in senders):
            return True
        if state.capture and not is_failed(state.payload):
            state.payload = self._status(state)
            if state.aborted and is_failed(state.payload):
                state.payload = TransferStatus.ABORTED
        return False

    def release(self, state: RequestState) -> None:
        self.accumulators.pop(state.request_id, None)
        with self._lock:
            senders = list(self.senders.values())
        for sender in senders:
            if state.transfer_id in sender.tracked():
                sender.forget(state.transfer_id)

    def sender_info(self) -> dict[str, Any]:
        with self._lock:
            senders = dict(self.senders)
        # Before a sender's first put, what its connector can say up front (a ZMQ endpoint):
        # async-chunk consumers start receiving before the producer put anything. With it,
        # the sender's doorbell, which wakes them when a payload lands.
        return {"payload": {peer: s.receiver_info() for peer, s in senders.items()}}

    def close(self, left: Callable[[], float]) -> None:
        with self._lock:
            senders, self.senders = list(self.senders.values()), {}
            receivers, self.receivers = list(self.receivers.values()), {}
        # Receivers first (they only wait), then senders: queued puts get what is left of
        # the budget, then their connectors are closed under them (the put fails, cleanly).
        for receiver in receivers:
            receiver.close(timeout=left())
        for sender in senders:
            sender.close(timeout=left())

    # -- receiver side -----------------------------------------------------------------------
    def expect(
        self,
        request_id: str,
        from_stage: int | str | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Start receiving ``request_id`` in the background (rank 0; a no-op on other ranks)."""
        if self.runtime.is_payload_rank:
            self.receiver(from_stage).expect(request_id, metadata=metadata)

    def get(
        self, request_id: str, from_stage: int | str | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Wait for an expected payload; every TP rank gets it (collective when TP > 1)."""
        result: dict[str, Any] | BaseException
        if self.runtime.is_payload_rank:
            try:
                result = self.receiver(from_stage).result(request_id, timeout)
            except KVBridgeError as exc:
                result = exc
        else:
            result = {}
        if self.runtime.tp_size > 1:
            if self.runtime.tp_group is None:
                raise ConfigError(
                    "TP > 1 needs a process group (kvbridge_init(tp_group=...)) for payload fan-out"
                )
            return broadcast_payload(result, self.runtime.tp_group, src=0)
        if isinstance(result, BaseException):
            raise result
        return result

    def cancel(self, request_id: str, from_stage: int | str | None = None) -> bool:
        if not self.runtime.is_payload_rank:
            return False
        return self.receiver(from_stage).cancel(request_id)

    # -- tests and health --------------------------------------------------------------------
    def threads_alive(self) -> int:
        """Background payload threads still running (0 after shutdown)."""
        with self._lock:
            objs = [*self.senders.values(), *self.receivers.values()]
        return sum(o.threads_alive() for o in objs)

    def debug_state(self) -> dict[str, Any]:
        with self._lock:
            senders, receivers = dict(self.senders), dict(self.receivers)
        return {
            "accumulators": list(self.accumulators),
            "payload_in_flight": {peer: s.in_flight() for peer, s in senders.items()},
            "payload_tracked": {peer: sorted(s.tracked()) for peer, s in senders.items()},
            "receiving": {peer: sorted(r.pending()) for peer, r in receivers.items()},
        }


@dataclass(frozen=True)
class StageTransport:
    """A stage rank's two layer objects, composed: what the facade mixin holds, and what the
    diffusion and vocoder runners hold directly."""

    runtime: StageRuntime
    payloads: PayloadFlows

    @classmethod
    def create(
        cls,
        settings: RunnerSettings | Mapping[str, Any] | None,
        tp: TPPosition = SINGLE_RANK,
        kv_manager_options: Mapping[str, Any] | None = None,
    ) -> StageTransport:
        runtime = StageRuntime(settings, tp, kv_manager_options)
        try:
            return cls(runtime, PayloadFlows(runtime))
        except BaseException:
            runtime.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the payload threads, then close the KV manager and connectors; idempotent."""
        self.runtime.shutdown()


__all__ = ["PayloadFlows", "StageTransport"]
