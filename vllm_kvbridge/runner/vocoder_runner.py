"""The vocoder runner: a streaming last stage that turns each arriving payload chunk into
audio at once (``kind: vocoder``; the third stage of thinker -> talker -> vocoder).

Like the diffusion runner it composes the facade (:class:`KVBridgeModelRunnerMixin`) for
its receive side only: the stage's payload receiver (connector lifecycle, ordered chunks,
``recv_timeout`` for the first chunk and ``stall_timeout`` between two, the producer's
abort) comes from the payload-transport layer. What it adds is what needs the module:

* :meth:`VocoderRunner.expect` starts receiving a request's stream; every chunk that
  lands is queued on the request's :class:`VocoderStream` (on the receive thread, in
  order: the receiver delivers chunk ``i`` before ``i + 1``);
* :meth:`VocoderRunner.advance` (the stage engine's worker thread) turns the chunks queued
  so far into samples through the module's ``forward_chunk``, carrying its streaming
  state from one chunk to the next, and says whether the stream is complete or failed.

The module contract is in :mod:`vllm_kvbridge.models.tiny_vocoder`. Chunks are vocoded in
arrival order, so the samples streamed out concatenate to what the module makes of the
whole stream (within the module's stated float tolerance).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvbridge.errors import TransferCorrupt
from vllm_kvbridge.runner.diffusion_runner import build_section_module
from vllm_kvbridge.runner.payload_flows import StageTransport
from vllm_kvbridge.runner.payload_receiver import ReceiveTiming

#: What the stage needs of its module (see models/tiny_vocoder.py).
MODULE_CONTRACT = ("sample_rate", "hop_length", "init_state", "forward_chunk")


@dataclass
class VocoderStream:
    """One request's stream: chunks that arrived and are not vocoded yet, the module's
    state after the last vocoded one, and what was made so far."""

    request_id: str
    from_stage: int
    state: Any
    started: float = field(default_factory=time.time)
    arrived: deque[tuple[int, dict[str, Any]]] = field(default_factory=deque)
    pieces: list[torch.Tensor] = field(default_factory=list)  # the samples made, per chunk
    chunks: int = 0  # chunks vocoded
    rows: int = 0
    samples: int = 0
    nbytes: int = 0  # payload bytes received
    first_at: float = 0.0  # time.time() of the first and last samples made
    last_at: float = 0.0
    #: the receiver's timing of the stream (set by :meth:`VocoderRunner.forget`)
    receive: ReceiveTiming | None = None


@dataclass
class Advance:
    """What :meth:`VocoderRunner.advance` made of a stream: the new samples (one tensor
    per chunk vocoded), and the stream's state: ``receiving``, ``done`` (every chunk
    arrived and was vocoded) or ``failed`` (``error`` says why)."""

    pieces: list[torch.Tensor]
    state: str
    error: str | None = None


def _payload_bytes(data: Mapping[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in data.values() if isinstance(v, torch.Tensor))


class VocoderRunner:
    """Build the module, receive each request's stream, vocode chunk by chunk."""

    def __init__(self, stage: Any) -> None:
        from vllm_kvbridge.config.runner_settings import runner_settings

        self.stage = stage
        v = stage.vocoder or {}
        self.input_key = str(v.get("input_key", "token_ids"))
        self.module = build_section_module(
            v, "vllm_kvbridge.models.tiny_vocoder.TinyVocoder", section="vocoder", required=MODULE_CONTRACT
        )
        self.sample_rate = int(self.module.sample_rate)
        #: the stage's connectors and payload receiver (runner/payload_flows.py)
        self.transport = StageTransport.create(runner_settings(stage))
        self._lock = threading.Lock()
        self._streams: dict[str, VocoderStream] = {}
        #: set when a chunk lands, so the worker vocodes it at once
        self.arrived = threading.Event()
        # Created now, not on the first request: a bad connector config fails the stage at start.
        self._receiver = self.transport.payloads.receiver()

    def expect(self, request_id: str, from_stage: int, metadata: Mapping[str, Any] | None) -> None:
        """Start receiving ``request_id``'s stream (its transfer id is the request id)."""
        with self._lock:
            self._streams[request_id] = VocoderStream(request_id, from_stage, self.module.init_state())
        self._receiver.expect(request_id, metadata=metadata, on_chunk=self._on_chunk)

    def _on_chunk(self, request_id: str, index: int, data: dict[str, Any]) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.arrived.append((index, data))
                stream.nbytes += _payload_bytes(data)
        self.arrived.set()

    def active(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    @torch.inference_mode()
    def advance(self, request_id: str, should_stop: Callable[[], bool] = lambda: False) -> Advance:
        """Vocode the chunks of ``request_id`` that arrived (worker thread); see :class:`Advance`.

        The stream's status is read *before* the queue is drained: a stream marked done then
        has every chunk queued already (the receiver calls back before it marks the end),
        so ``done`` is never reported with a chunk left unvocoded."""
        status = self._receiver.status(request_id)
        pieces: list[torch.Tensor] = []
        while not should_stop():
            with self._lock:
                stream = self._streams.get(request_id)
                if stream is None or not stream.arrived:
                    break
                index, data = stream.arrived.popleft()
            try:
                samples = self._vocode(stream, index, data)
            except Exception as exc:
                return Advance(pieces, "failed", f"{type(exc).__name__}: {exc}")
            if samples.numel():
                pieces.append(samples)
        if status is None:
            return Advance(pieces, "failed", f"request {request_id!r} is not being received")
        state, error = status
        if state == "receiving" or (state == "done" and self._queued(request_id)):
            return Advance(pieces, "receiving")
        if state == "done":
            return Advance(pieces, "done")
        return Advance(pieces, "failed", str(error) if error is not None else state)

    def _queued(self, request_id: str) -> bool:
        with self._lock:
            stream = self._streams.get(request_id)
            return stream is not None and bool(stream.arrived)

    def _vocode(self, stream: VocoderStream, index: int, data: Mapping[str, Any]) -> torch.Tensor:
        rows = data.get(self.input_key)
        if rows is None:
            raise TransferCorrupt(
                f"chunk {index} of request {stream.request_id!r} from stage {stream.from_stage} has no "
                f"{self.input_key!r} (it has {sorted(data)})"
            )
        rows = torch.as_tensor(rows)
        try:
            samples, stream.state = self.module.forward_chunk(rows, stream.state)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise TransferCorrupt(
                f"chunk {index} of request {stream.request_id!r} from stage {stream.from_stage}: {exc}"
            ) from exc
        samples = samples.detach().reshape(-1).to("cpu", torch.float32)
        now = time.time()
        stream.first_at = stream.first_at or now
        stream.last_at = now
        stream.chunks += 1
        stream.rows += int(rows.shape[0]) if rows.dim() else 1
        stream.samples += samples.numel()
        stream.pieces.append(samples)
        return samples

    def forget(self, request_id: str) -> VocoderStream | None:
        """``request_id`` ended (done, failed, aborted): stop its receive, drop its state."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.receive = self._receiver.timing(request_id)
        self._receiver.cancel(request_id)
        return stream

    def withdraw(self, request_id: str) -> bool:
        """Give up ``request_id`` unless its stream is complete (its producer was lost): True
        when it was still receiving and is withdrawn now (decided once, by the receiver)."""
        if not self._receiver.withdraw(request_id):
            return False
        with self._lock:
            self._streams.pop(request_id, None)
        return True

    def close(self) -> None:
        with self._lock:
            self._streams.clear()
        self.transport.shutdown()
