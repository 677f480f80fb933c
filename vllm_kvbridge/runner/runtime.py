"""``_ConnectorRuntimeMixin``: the runtime layer on a runner (the lowest of the three:
runtime <- payload transport <- facade).

Thin: its one object is :attr:`~_ConnectorRuntimeMixin.kvbridge_runtime`, a
:class:`~vllm_kvbridge.runner.stage_runtime.StageRuntime` (connectors, rank routing,
per-request state, the KV manager and the KV sender's status), which the facade's
``kvbridge_init`` builds. The methods here are what a host runner calls on it; everything
else is reached through the object itself (``runner.kvbridge_runtime.sender_info(...)``).
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.payload_flows import StageTransport
from vllm_kvbridge.runner.stage_runtime import StageRuntime


class _ConnectorRuntimeMixin:
    """Request lifecycle and shutdown, delegated to the stage's :class:`StageRuntime`."""

    #: Both layers' objects (None until ``kvbridge_init``).
    _kvb_transport: StageTransport | None = None

    @property
    def kvbridge_runtime(self) -> StageRuntime:
        """This layer's object (``kvbridge_init`` builds it)."""
        if self._kvb_transport is None:
            raise ConfigError(f"{type(self).__name__}: kvbridge_init() was not called")
        return self._kvb_transport.runtime

    def kvbridge_mark_finished(self, request_id: str, *, aborted: bool = False) -> None:
        """The request ended (finished or aborted): its payloads are flushed or cancelled and
        its state goes once nothing is in flight."""
        self.kvbridge_runtime.mark_finished(request_id, aborted=aborted)

    def kvbridge_transfer_status(self, request_ids: Iterable[str] | None = None) -> dict[str, dict[str, str]]:
        """Per transfer id: ``{"kv": ..., "payload": ..., "aborted": ...}``
        (:meth:`StageRuntime.transfer_status`)."""
        return self.kvbridge_runtime.transfer_status(request_ids)

    def kvbridge_shutdown(self) -> None:
        """Stop the payload threads, close the KV manager and every connector; idempotent."""
        if self._kvb_transport is not None:
            self._kvb_transport.shutdown()
