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
:class:`RunnerHost` lists what the host provides. Only KV *senders* need the hooks
(``kvbridge_kv_caches``, ``kvbridge_block_size``; ``kvbridge_cache_dtype`` defaults to the
first cache's dtype). The mixin calls into the host only from those hooks; the host calls
the mixin:

* ``kvbridge_init(settings, tp_rank=, tp_size=, tp_group=)`` once, before anything else;
* ``kvbridge_register_request(id, transfer_id, capture=)`` when a request starts (optional:
  the other calls register on first use);
* ``kvbridge_add_step_output(id, outputs)`` after every step of a captured request;
* ``kvbridge_send_kv([(id, block_ids, num_tokens)])`` when a request's KV is due, *before*
  its blocks can be reused (the gather copies them on the calling thread);
* ``kvbridge_mark_finished(id, aborted=)`` when it ends (flushes or cancels payloads; the
  state is dropped once nothing is in flight);
* ``kvbridge_shutdown()`` at the end.

vLLM runners get all of this from :mod:`vllm_kvbridge.runner.ar_runner`, where
:meth:`KVBridgeModelRunnerMixin.kvbridge_connector_step` is driven by the vLLM KV
connector (:mod:`vllm_kvbridge.runner.vllm_connector`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from vllm_kvbridge.runner.payload_transport import _PayloadTransportMixin

logger = logging.getLogger(__name__)


@runtime_checkable
class RunnerHost(Protocol):
    """What a runner class composed with the mixin provides (KV senders only)."""

    def kvbridge_kv_caches(self) -> Sequence[Any]:
        """Per-layer paged KV cache tensors, in layer order."""
        ...

    def kvbridge_block_size(self) -> int:
        """Tokens per block of the block ids passed to ``kvbridge_send_kv``."""
        ...

    def kvbridge_cache_dtype(self) -> Any:
        """The KV cache dtype (torch dtype or vLLM ``cache_dtype`` string)."""
        ...


class KVBridgeModelRunnerMixin(_PayloadTransportMixin):
    """The facade: everything of the runtime and payload layers plus the vLLM connector hook."""

    def kvbridge_connector_step(self, sends: Sequence[Any], finished: Mapping[str, tuple[str, str]]) -> None:
        """One engine step's work from the vLLM KV connector (runs after the forward).

        ``sends``: :class:`~vllm_kvbridge.runner.vllm_connector.KVSendSpec` items; the gather
        happens here, while the scheduler still holds their blocks. ``finished``: internal id ->
        (``"finished"``/``"aborted"``, transfer id) of requests that ended since the last step.

        Runs inside vLLM's ``wait_for_save``: an error here would take the engine down, so it
        fails the requests it concerns (their status says why) and never propagates.
        """
        if sends:
            try:
                for spec in sends:
                    self.kvbridge_register_request(spec.req_id, spec.transfer_id)
                self.kvbridge_send_kv(
                    [
                        (
                            s.req_id,
                            s.block_ids,
                            s.num_tokens,
                            {"purpose": s.purpose, "companion_of": s.companion_of},
                        )
                        for s in sends
                    ]
                )
            except Exception as exc:
                logger.exception("kvbridge: KV sends of this step could not start")
                why = f"KV send could not start: {type(exc).__name__}: {exc}"
                for spec in sends:
                    self.kvbridge_fail_request(spec.req_id, "kv", why)
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
        with self._kvb_lock:
            senders = dict(self._kvb_senders)
            receivers = dict(self._kvb_receivers)
        return {
            "pid": os.getpid(),
            "requests": self.kvbridge_active_requests(),
            "accumulators": list(self._kvb_acc),
            "payload_in_flight": {peer: s.in_flight() for peer, s in senders.items()},
            "payload_tracked": {peer: sorted(s.tracked()) for peer, s in senders.items()},
            "receiving": {peer: sorted(r.pending()) for peer, r in receivers.items()},
            "kv_pending": self._kvb_kv_manager.pending_sends() if self._kvb_kv_manager is not None else 0,
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kvbridge-")),
        }


__all__ = ["KVBridgeModelRunnerMixin", "RunnerHost"]
