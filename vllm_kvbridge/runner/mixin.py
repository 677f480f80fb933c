"""``KVBridgeModelRunnerMixin``: the public facade runners subclass.

Compose it *before* the runner class, the way vLLM composes its own mixins into
``GPUModelRunner``::

    class MyRunner(KVBridgeModelRunnerMixin, SomeRunner):
        def __init__(self, ...):
            super().__init__(...)
            self.kvbridge_init(settings, tp_rank=..., tp_size=..., tp_group=...)

The layers: :class:`~vllm_kvbridge.runner.runtime._ConnectorRuntimeMixin` (connectors,
rank routing, per-request state, KV manager) <-
:class:`~vllm_kvbridge.runner.payload_transport._PayloadTransportMixin` (payload flows)
<- this facade. Nothing here imports vLLM: a non-vLLM runner (the diffusion runner) uses
the receive side (``kvbridge_kv_manager``, ``kvbridge_expect_payload`` /
``kvbridge_get_payload``) with no host hooks at all.

Host contract
-------------
KV is not the runner's business: vLLM hands its paged caches to the KV connector
(``register_kv_caches``), whose worker half gathers and sends
(:mod:`vllm_kvbridge.runner.kv_sender`), with or without this mixin. What the host runner
does, and on which thread:

* ``kvbridge_init(settings, tp_rank=, tp_size=, tp_group=)`` once, before anything else;
* ``kvbridge_attach_kv_sender(sender)`` once the connector built its sender (a runner that
  sends KV; status and sender info then answer for both);
* ``kvbridge_register_request(id, transfer_id, capture=)`` when a request starts (optional:
  the other calls register on first use);
* ``kvbridge_add_step_output(id, outputs)`` after every step of a captured request, on the
  model thread;
* ``kvbridge_mark_finished(id, aborted=)`` when it ends (flushes or cancels payloads; the
  state is dropped once nothing is in flight); vLLM runners get it through
  :meth:`KVBridgeModelRunnerMixin.kvbridge_connector_step`, from the connector's
  ``wait_for_save``;
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

from vllm_kvbridge.runner.payload_transport import _PayloadTransportMixin

logger = logging.getLogger(__name__)


@runtime_checkable
class RunnerHost(Protocol):
    """What every vLLM runner (V1, V2, CPU) provides to the shared hooks of the AR runners.

    Where a step's rows are is runner-specific: each AR runner's own hook hands the
    capture a list of ``(request id, first row, rows, first position)``.
    """

    vllm_config: Any

    def get_model(self) -> Any: ...


class KVBridgeModelRunnerMixin(_PayloadTransportMixin):
    """The facade: everything of the runtime and payload layers plus the vLLM connector hook."""

    def kvbridge_connector_step(
        self, finished: Mapping[str, tuple[str, str]], capture: Mapping[str, Any] | None = None
    ) -> None:
        """Requests that ended since the last step, from the vLLM KV connector (after the
        forward): internal id -> (``"finished"``/``"aborted"``, transfer id). ``capture``:
        the scheduler's updates of capturing requests (:class:`~vllm_kvbridge.runner.capture.
        CaptureUpdate`), which the AR runners pair with their rows before this runs.

        Runs inside vLLM's ``wait_for_save``: an error here would take the engine down, so it
        fails the payload of the request it concerns (its status says why) and never propagates.
        """
        for req_id, (kind, _transfer_id) in finished.items():
            aborted = kind == "aborted"
            try:
                self.kvbridge_mark_finished(req_id, aborted=aborted)
            except Exception as exc:
                logger.exception("kvbridge: finishing request %s failed", req_id)
                why = f"{type(exc).__name__}: {exc}"
                self.kvbridge_fail_request(req_id, "payload", why, finished=True, aborted=aborted)

    def kvbridge_debug_state(self) -> dict[str, Any]:
        """Live per-request state, in-flight puts and background threads (tests, health)."""
        self.kvbridge_reap()
        with self._kvb.lock:
            senders = dict(self._kvb_payload.senders)
            receivers = dict(self._kvb_payload.receivers)
        return {
            "pid": os.getpid(),
            "requests": self.kvbridge_active_requests(),
            "accumulators": list(self._kvb_payload.acc),
            "payload_in_flight": {peer: s.in_flight() for peer, s in senders.items()},
            "payload_tracked": {peer: sorted(s.tracked()) for peer, s in senders.items()},
            "receiving": {peer: sorted(r.pending()) for peer, r in receivers.items()},
            "kv_pending": self.kvbridge_kv_sender.pending() if self.kvbridge_kv_sender is not None else 0,
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kvbridge-")),
        }


__all__ = ["KVBridgeModelRunnerMixin", "RunnerHost"]
