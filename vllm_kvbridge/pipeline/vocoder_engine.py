"""The engine of a vocoder stage (``kind: vocoder``): audio streamed out as chunks land.

A request is received from the moment it is submitted, which for an async-chunk edge is
when its producer's request starts (the orchestrator submits down async-chunk edges at
once). One worker thread vocodes every chunk as soon as it arrived
(:meth:`~vllm_kvbridge.runner.vocoder_runner.VocoderRunner.advance`, woken by the
receiver), so the stage makes audio while its producer (a talker) still generates. A
request submitted with ``stream`` gets a ``StageProgress`` carrying each chunk's samples
(``audio_delta``) as they are made; every request ends with a ``StageDone`` holding all
its samples (``audio``, float32 in [-1, 1], ``output["sample_rate"]``) and the wall-clock
times of its first and last samples (``first_token_at`` / ``last_token_at``, one clock
with the LLM stages' token times). A stream that stalls, that its producer aborts, or
whose chunk the module cannot take fails the request with the reason; the others go on.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from vllm_kvbridge.config.resolve import ResolvedStage
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.engines import ExpiringIds, StageEngine, drain_results, producer_lost_failure

if TYPE_CHECKING:
    from vllm_kvbridge.runner.vocoder_runner import VocoderStream

#: How often the worker looks at the streams' status while nothing arrives: a stream's
#: end (a finish marker without rows) or its stall is noticed within this.
POLL_S = 0.01


class VocoderStageEngine(StageEngine):
    def __init__(self, stage: ResolvedStage) -> None:
        super().__init__(stage)
        from vllm_kvbridge.runner.vocoder_runner import VocoderRunner

        self.runner = VocoderRunner(stage)
        self._lock = threading.Lock()
        #: request id -> (submit message, producer stage), while it is being received
        self._requests: dict[str, tuple[m.Submit, int]] = {}
        self._aborted = ExpiringIds()
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="kvbridge-vocoder", daemon=True)
        self._thread.start()

    def info(self) -> dict[str, Any]:
        return {"kind": "vocoder", "sample_rate": self.runner.sample_rate}

    def submit(self, msg: m.Submit) -> None:
        if not msg.upstream:
            raise ValueError(f"request {msg.request_id!r}: a vocoder stage needs an upstream payload")
        up = msg.upstream[0]
        meta = (up.sender_info.get("payload") or {}).get(str(self.stage.stage_id)) or None
        with self._lock:
            self._requests[msg.request_id] = (msg, up.from_stage)
        self.runner.expect(msg.request_id, up.from_stage, meta)

    def busy(self) -> bool:
        return not self._done.empty()

    def step(self) -> list[Any]:
        return drain_results(self._done)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            with self._lock:
                self._aborted.add(rid)
                known = self._requests.pop(rid, None)
            if known is not None:
                self.runner.forget(rid)

    def producer_lost(self, msg: m.ProducerLost) -> list[m.RequestFailed]:
        receiver = self.runner.transport.payloads.receiver()
        if getattr(receiver.connector, "data_outlives_sender", True):
            return []  # what it put is still readable: the stream completes or stalls
        out = []
        for rid in msg.request_ids:
            with self._lock:
                entry = self._requests.get(rid)
                if entry is None or entry[1] != msg.stage_id or not self.runner.withdraw(rid):
                    continue
                del self._requests[rid]
            out.append(producer_lost_failure(msg, rid, self.stage, "payload"))
        return out

    def edge_counters(self) -> dict[str, float]:
        return self.runner.transport.runtime.edge_counters()

    # -- the worker thread -----------------------------------------------------------------
    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stop:
                        return
                    rids = list(self._requests)
                self.runner.arrived.wait(POLL_S if rids else 0.1)
                self.runner.arrived.clear()
                for rid in rids:
                    self._advance(rid)
        except BaseException as exc:  # an engine bug: fail the stage, loudly
            traceback.print_exc()
            self._done.put(exc)

    def _gone(self, rid: str) -> bool:
        with self._lock:
            return rid not in self._requests or self._stop

    def _advance(self, rid: str) -> None:
        step = self.runner.advance(rid, should_stop=lambda: self._gone(rid))
        with self._lock:
            entry = self._requests.get(rid)
            if entry is None:  # aborted or lost meanwhile: it reports nothing more
                return
            msg = entry[0]
            if step.state != "receiving":
                del self._requests[rid]
        if msg.stream:
            for piece in step.pieces:
                self._done.put(m.StageProgress(rid, self.stage.stage_id, audio_delta=m.tensor_to_msg(piece)))
        if step.state == "receiving":
            return
        stream = self.runner.forget(rid)
        if step.state == "failed" or stream is None:
            self._done.put(m.RequestFailed(rid, self.stage.stage_id, str(step.error)))
            return
        self._done.put(self._done_msg(msg, stream))

    def _done_msg(self, msg: m.Submit, stream: VocoderStream) -> m.StageDone:
        import torch

        audio = torch.cat(stream.pieces) if stream.pieces else torch.zeros(0)
        finished = time.time()
        receive = stream.receive
        # seconds: the gets themselves; the wait for the producer's stream goes to waited_s
        transfer = m.TransferStat(
            stream.from_stage,
            self.stage.stage_id,
            "chunks",
            stream.nbytes,
            receive.get_s if receive is not None else finished - stream.started,
            "receiver",
            waited_s=receive.waited_s if receive is not None else 0.0,
            ready_at=receive.ready_at if receive is not None else 0.0,
        )
        return m.StageDone(
            msg.request_id,
            self.stage.stage_id,
            output={
                "sample_rate": self.runner.sample_rate,
                "num_samples": stream.samples,
                "chunks": stream.chunks,
                "rows": stream.rows,
            },
            audio=m.tensor_to_msg(audio),
            started=stream.started,
            finished=finished,
            transfers=[transfer],
            first_token_at=stream.first_at,
            last_token_at=stream.last_at,
        )

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self.runner.arrived.set()
        self._thread.join(timeout=10)
        self.runner.close()
