"""``StepCapture``: the AR runners' hidden-state capture, one object per runner.

The AR runners (:mod:`vllm_kvbridge.runner.ar_runner`) hold one and call it from their vLLM
hooks: :meth:`StepCapture.capture_rows` after the forward with where each scheduled
request's rows are, and :meth:`StepCapture.on_step` with the scheduler's updates (through
the facade's ``kvbridge_connector_step``). The pairing rule is
:mod:`vllm_kvbridge.runner.capture`'s; what it emits goes to the payload flows. Nothing
here imports vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from vllm_kvbridge.runner.capture import CaptureUpdate, RequestCapture, RowBlock, StepRows
from vllm_kvbridge.runner.payload_flows import StageTransport

logger = logging.getLogger(__name__)

#: One request's rows in a step's hidden-state tensor: (id, first row, rows, first position).
BatchSpan = tuple[str, int, int, int]
#: The subclass hook: (request id, its rows of this step on the device) -> extra CPU tensors.
StepExtras = Callable[[str, torch.Tensor], Mapping[str, torch.Tensor]]


class StepCapture:
    """Per captured request (announced by the scheduler), its rows and tokens until emitted."""

    def __init__(self, transport: StageTransport, step_extras: StepExtras) -> None:
        self.transport = transport
        self.payload = transport.runtime.settings.payload
        self.on = self.payload.captures
        self._step_extras = step_extras
        #: the step's SchedulerOutput (the runner's ``execute_model``), read by the forward hooks
        self.scheduler_output: Any = None
        self.requests: dict[str, RequestCapture] = {}
        #: a fed stage (``feed: per_step``): the model's conditioning width (runner/conditioning.py)
        self.feed_dim: int | None = None
        #: engine steps this runner executed (with or without a forward), for tests and health
        self.steps = 0
        #: device-to-host copies of captured hidden rows (one per step that captured any)
        self.row_copies = 0

    # -- rows (model thread, after the forward) ------------------------------------------------
    def capture_rows(self, hidden: torch.Tensor, batch: list[BatchSpan]) -> None:
        """Record this step's rows of every captured request (``batch``: where each
        scheduled request's rows are in ``hidden`` and the position of its first one)."""
        if not self.transport.runtime.is_payload_rank:
            return
        meta = getattr(self.scheduler_output, "kv_connector_metadata", None)
        announced = getattr(meta, "capture", None) or {}
        step = StepRows()
        spans: dict[str, tuple[int, int]] = {}
        hidden_rows = self.payload.capture_hidden_states
        for req_id, start_row, n, first_pos in batch:
            capture = self.capture_of(req_id, announced.get(req_id))
            if capture is None or n <= 0:
                continue
            done = capture.captured
            if first_pos > done:
                # Rows [done, first_pos) were never computed by this engine: a prefix-cache
                # hit. A payload without them would be silently short, so fail instead.
                self.drop(
                    req_id,
                    f"hidden-state capture would miss prompt positions {done}..{first_pos - 1}: "
                    "they came from vLLM's prefix cache; send capturing requests with "
                    "SamplingParams(skip_reading_prefix_cache=True) (the pipeline does) or start "
                    "the stage with enable_prefix_caching=False",
                )
                continue
            # Rows recomputed after a preemption were captured before: skip them.
            skip = max(0, min(n, done - first_pos))
            if skip == n:
                continue
            rows = hidden[start_row + skip : start_row + n]
            try:
                extras = dict(self._step_extras(req_id, rows.detach()))
            except Exception as exc:  # a subclass's hook fails its request, never the engine
                logger.exception("kvbridge: kvbridge_step_extras failed for %s", req_id)
                self.drop(req_id, f"kvbridge_step_extras: {type(exc).__name__}: {exc}")
                continue
            if hidden_rows:
                spans[req_id] = (start_row + skip, start_row + n)
            capture.blocks.append(
                RowBlock(req_id, first_pos + skip, n - skip, extras, step if hidden_rows else None)
            )
            capture.captured = first_pos + n
        if spans:
            # One non-blocking copy of every request's rows (no sync per request); each
            # request takes its rows when its tokens are known (a step later, or two).
            step.stage(hidden.detach(), spans)
            self.row_copies += 1

    def capture_of(self, req_id: str, update: CaptureUpdate | None) -> RequestCapture | None:
        """The request's capture record; created when the scheduler announces the request."""
        capture = self.requests.get(req_id)
        if capture is not None or update is None:
            return capture
        state = self.transport.runtime.register(req_id, update.transfer_id, capture=True)
        if not state.capture or state.finished:
            return None
        capture = self.requests[req_id] = RequestCapture(update.transfer_id, update.num_prompt_tokens)
        return capture

    def drop(self, req_id: str, reason: str) -> None:
        self.requests.pop(req_id, None)
        self.transport.payloads.fail_capture(req_id, reason)

    # -- tokens (after the step, from the connector's metadata) ---------------------------------
    def on_step(self, finished: Mapping[str, tuple[str, str]], updates: Mapping[str, CaptureUpdate]) -> None:
        """Pair the scheduler's tokens with the recorded rows and emit what is complete (the
        whole rest for requests that ended)."""
        # Only the payload rank captures (the others record no rows either).
        updates = updates if self.transport.runtime.is_payload_rank else {}
        for req_id, update in updates.items():
            record = self.capture_of(req_id, update)
            ended = finished.get(req_id)
            try:
                if record is not None:
                    record.add_tokens(update)
                    final = ended is not None and ended[0] == "finished"
                    for outputs, num_tokens in record.take_ready(
                        final=final,
                        hidden=self.payload.capture_hidden_states,
                        token_ids=self.payload.capture_token_ids,
                    ):
                        self.transport.payloads.add_step_output(req_id, outputs, num_tokens=num_tokens)
            except Exception as exc:  # never the engine: this request's payload fails
                logger.exception("kvbridge: capture of %s failed", req_id)
                self.drop(req_id, f"{type(exc).__name__}: {exc}")
        for req_id, (kind, _tid) in finished.items():
            if self.requests.pop(req_id, None) is not None and kind == "finished" and req_id not in updates:
                # Its last tokens come with its end; without them the payload would be short.
                self.transport.payloads.fail_capture(
                    req_id, "the scheduler's final tokens of this request never arrived"
                )

    def debug_state(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "capture_row_copies": self.row_copies,
            "capturing": sorted(self.requests),
        }


__all__ = ["BatchSpan", "StepCapture", "StepExtras"]
