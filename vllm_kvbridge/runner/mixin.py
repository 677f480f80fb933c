"""``KVBridgeModelRunnerMixin``: the public facade runners subclass.

Compose it *before* the runner class, the way vLLM composes its own mixins into
``GPUModelRunner``::

    class MyRunner(KVBridgeModelRunnerMixin, SomeRunner):
        def __init__(self, ...):
            super().__init__(...)
            self.kvbridge_init(settings, tp_rank=..., tp_size=..., tp_group=...)

The layers, each thin over one composed object that owns its state and threads:
:class:`~vllm_kvbridge.runner.runtime._ConnectorRuntimeMixin` over
:class:`~vllm_kvbridge.runner.stage_runtime.StageRuntime` (connectors, rank routing,
per-request state, KV manager) <-
:class:`~vllm_kvbridge.runner.payload_transport._PayloadTransportMixin` over
:class:`~vllm_kvbridge.runner.payload_flows.PayloadFlows` (payload flows) <- this facade,
which builds both (:class:`~vllm_kvbridge.runner.payload_flows.StageTransport`) and takes
the connector's step. The objects meet through typed contracts declared where they are
used (:class:`~vllm_kvbridge.runner.stage_runtime.RequestFlows`, :class:`StepHook`), never
through ``super()`` chains. Nothing here imports vLLM; the diffusion and vocoder runners
hold a ``StageTransport`` directly instead of this facade.

Host contract
-------------
KV is not the runner's business: vLLM hands its paged caches to the KV connector
(``register_kv_caches``), whose worker side gathers and sends
(:mod:`vllm_kvbridge.runner.kv_sender`), with or without this mixin. What the host runner
does, and on which thread:

* ``kvbridge_init(settings, tp_rank=, tp_size=, tp_group=)`` once, before anything else;
* ``kvbridge_runtime.use_kv_sender_of(connector_worker)`` when the stage sends KV (status and
  sender info then answer for both);
* ``kvbridge_add_step_output(id, outputs)`` after every step of a captured request, on the
  model thread (it registers the request on first use);
* ``kvbridge_mark_finished(id, aborted=)`` when it ends (flushes or cancels payloads; the
  state is dropped once nothing is in flight); vLLM runners get it through
  :meth:`KVBridgeModelRunnerMixin.kvbridge_connector_step`, which they call after each
  ``execute_model`` with what the connector's worker side saw end in that step;
* ``kvbridge_shutdown()`` at the end.

:class:`RunnerHost` is the part of vLLM's runner the shared AR hooks read
(:mod:`vllm_kvbridge.runner.ar_runner` checks it at start-up); a custom runner for another
engine provides the same.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from vllm_kvbridge.runner.payload_flows import StageTransport
from vllm_kvbridge.runner.payload_transport import _PayloadTransportMixin
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.stage_runtime import TPPosition

logger = logging.getLogger(__name__)


@runtime_checkable
class RunnerHost(Protocol):
    """What every vLLM runner (V1, V2, CPU) provides to the shared hooks of the AR runners.

    Where a step's rows are is runner-specific: each AR runner's own hook hands the
    capture a list of ``(request id, first row, rows, first position)``.
    """

    vllm_config: Any

    def get_model(self) -> Any: ...


class StepHook(Protocol):
    """What the facade calls each step before finishing requests: the AR runners' capture
    (:class:`~vllm_kvbridge.runner.step_capture.StepCapture`) pairs the scheduler's tokens
    with its rows here."""

    def on_step(self, finished: Mapping[str, tuple[str, str]], updates: Mapping[str, Any]) -> None: ...

    def debug_state(self) -> dict[str, Any]: ...


class KVBridgeModelRunnerMixin(_PayloadTransportMixin):
    """The facade: builds both layers' objects and takes the vLLM connector's step."""

    #: The AR runners' capture, called each step (None on runners that capture nothing).
    _kvb_step_hook: StepHook | None = None

    def kvbridge_init(
        self,
        settings: RunnerSettings | Mapping[str, Any] | None,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        tp_group: Any = None,
    ) -> None:
        """Build the stage's runtime and payload flows; nothing is connected until first
        used (or ``kvbridge_payloads.connect()``)."""
        self._kvb_transport = StageTransport.create(settings, TPPosition(tp_rank, tp_size, tp_group))

    def kvbridge_connector_step(
        self, finished: Mapping[str, tuple[str, str]], capture: Mapping[str, Any] | None = None
    ) -> None:
        """Requests that ended since the last step, from the vLLM KV connector (after the
        forward): internal id -> (``"finished"``/``"aborted"``, transfer id). ``capture``:
        the scheduler's updates of capturing requests (:class:`~vllm_kvbridge.runner.capture.
        CaptureUpdate`), which the step hook pairs with its rows before requests finish.

        Runs inside vLLM's step: an error here would take the engine down, so it fails the
        payload of the request it concerns (its status says why) and never propagates.
        """
        if self._kvb_step_hook is not None:
            self._kvb_step_hook.on_step(finished, capture or {})
        runtime = self.kvbridge_runtime
        for req_id, (kind, _transfer_id) in finished.items():
            aborted = kind == "aborted"
            try:
                runtime.mark_finished(req_id, aborted=aborted)
            except Exception as exc:
                logger.exception("kvbridge: finishing request %s failed", req_id)
                why = f"{type(exc).__name__}: {exc}"
                runtime.fail(req_id, why, finished=True, aborted=aborted)

    def kvbridge_debug_state(self) -> dict[str, Any]:
        """Live per-request state, in-flight puts and background threads (tests, health)."""
        runtime = self.kvbridge_runtime
        runtime.reap()
        sender = runtime.kv_sender
        with runtime.lock:
            requests = list(runtime.requests)
        return {
            "pid": os.getpid(),
            "requests": requests,
            **self.kvbridge_payloads.debug_state(),
            "kv_pending": sender.pending() if sender is not None else 0,
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kvbridge-")),
            **(self._kvb_step_hook.debug_state() if self._kvb_step_hook is not None else {}),
        }


__all__ = ["KVBridgeModelRunnerMixin", "RunnerHost", "StepHook"]
