"""The scheduler of a fed stage (``payload.feed: per_step``): runs a request only for
positions whose conditioning rows arrived (see :mod:`vllm_kvbridge.runner.conditioning`).

Why a scheduler subclass here, when the rest of kvbridge keeps to vLLM's KV-connector API:
that API can hold back a *waiting* request (``get_num_new_matched_tokens`` returning
``None``: "ask again later", which the connector does for a fed request's prompt), but
nothing in it can leave a *running* request out of one step. So this class overrides the
two public methods of vLLM's scheduler interface, and nothing private:

* ``schedule``: running requests that are ahead of their producer are taken out of
  ``running`` for the call and put back after it, in front (they are the older requests).
  While out they count against ``max_num_seqs`` like vLLM's own paused streaming-input
  sessions (``num_waiting_for_streaming_input``), keep their KV blocks, and cannot be
  preempted. When every request is held back (nothing could run), it first sleeps on the
  feed's arrival event, up to :data:`IDLE_WAIT_S`, so the engine core does not spin
  through empty steps while it waits for a producer.
* ``update_from_output``: a request whose stream failed (stalled past
  ``stall_timeout_s``, aborted by its producer, corrupt) is finished with
  ``FINISHED_ERROR``; its output carries ``kv_transfer_params["kvbridge_error"]`` (the
  reason), which the stage engine reports as the request's failure.

:class:`KVBridgeScheduler` extends vLLM's ``Scheduler``, :class:`KVBridgeAsyncScheduler`
its ``AsyncScheduler`` (GPU default); :func:`scheduler_cls_for` picks one, and
:func:`vllm_kvbridge.runner.worker.engine_kwargs` sets it for fed stages.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

#: Longest sleep of an engine core whose every request waits for its producer (a row's
#: arrival ends it at once). It bounds how late what does not set the arrival event is
#: seen: a new unfed request or an abort starts or ends, a stall or a producer's abort
#: fails its request, up to this late. Why not shorter: every empty step is an RPC round
#: trip to the worker, and a fed stage stepping every 20 ms while it waited for its
#: producer starved the producer's engine on 2 CPU cores (a thinker took over 30 s for its
#: first 4 tokens in 4 of 7 runs of thinker_talker_async_chunk.yaml; with 0.25 s, in none
#: of 7, nor in 11 with 1.2 s, which delayed the stage's RPCs and new requests more).
IDLE_WAIT_S = 0.25

#: Key of a failed fed request's reason in its output's ``kv_transfer_params``.
ERROR_KEY = "kvbridge_error"


class _FeedGateMixin:
    """The gate, on top of vLLM's ``Scheduler`` (see the module docstring)."""

    running: list[Any]
    waiting: Any
    connector: Any
    num_waiting_for_streaming_input: int

    def _kvbridge_held(self) -> list[Any]:
        blocked = getattr(self.connector, "kvbridge_running_blocked", None)
        if blocked is None:
            return []
        return [r for r in self.running if blocked(r)]

    def _kvbridge_all_waiting(self, held: list[Any]) -> bool:
        """Whether nothing at all could run this step: every running request is held and
        every waiting one is a fed request whose prompt rows have not arrived."""
        waiting_blocked = getattr(self.connector, "kvbridge_waiting_blocked", None)
        if waiting_blocked is None or len(held) != len(self.running):
            return False
        waiting = list(self.waiting)
        if not (held or waiting):
            return False
        return all(waiting_blocked(r) for r in waiting)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        held = self._kvbridge_held()
        if self._kvbridge_all_waiting(held) and self.connector.kvbridge_wait_for_rows(IDLE_WAIT_S):
            held = self._kvbridge_held()
        if not held:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        ids = {id(r) for r in held}
        self.running = [r for r in self.running if id(r) not in ids]
        self.num_waiting_for_streaming_input += len(held)
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            self.num_waiting_for_streaming_input -= len(held)
            self.running = held + self.running

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        take = getattr(self.connector, "kvbridge_take_feed_failures", None)
        failures = take() if take is not None else {}
        if failures:
            self._kvbridge_fail(failures, outputs)
        return outputs

    def _kvbridge_fail(self, failures: dict[str, str], outputs: dict[int, Any]) -> None:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
        from vllm.v1.request import RequestStatus

        for request in self.finish_requests(list(failures), RequestStatus.FINISHED_ERROR):  # type: ignore[attr-defined]
            reason = failures[request.request_id]
            logger.error("kvbridge: request %s failed: %s", request.request_id, reason)
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    kv_transfer_params={ERROR_KEY: reason},
                    trace_headers=request.trace_headers,
                )
            )


class KVBridgeScheduler(_FeedGateMixin, Scheduler):
    """vLLM's ``Scheduler`` with the per-step conditioning gate."""


class KVBridgeAsyncScheduler(_FeedGateMixin, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with the per-step conditioning gate."""


def scheduler_cls_for(async_scheduling: bool | None) -> str:
    """The dotted path of the gated scheduler matching ``async_scheduling``."""
    name = "KVBridgeAsyncScheduler" if async_scheduling else "KVBridgeScheduler"
    return f"{__name__}.{name}"
