"""``_PayloadTransportMixin``: the payload layer on a runner (full-payload and async-chunk
flows, TP fan-out).

Thin: its one object is :attr:`~_PayloadTransportMixin.kvbridge_payloads`, a
:class:`~vllm_kvbridge.runner.payload_flows.PayloadFlows` (senders, receivers, accumulators
and their threads; the flows are described there). The methods here are what a host runner
calls from its model thread; the rest is on the object (``runner.kvbridge_payloads.receiver()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvbridge.runner.payload_flows import PayloadFlows
from vllm_kvbridge.runner.runtime import _ConnectorRuntimeMixin


class _PayloadTransportMixin(_ConnectorRuntimeMixin):
    """Payload build, send and receive, delegated to the stage's :class:`PayloadFlows`."""

    @property
    def kvbridge_payloads(self) -> PayloadFlows:
        """This layer's object (``kvbridge_init`` builds it)."""
        runtime = self.kvbridge_runtime  # a clear error before kvbridge_init
        assert self._kvb_transport is not None and self._kvb_transport.runtime is runtime
        return self._kvb_transport.payloads

    def kvbridge_add_step_output(
        self, request_id: str, outputs: Mapping[str, Any], *, num_tokens: int = 1
    ) -> None:
        """Add one step's outputs of a captured request (model thread); puts a chunk when
        one is due. ``num_tokens``: tokens the request generated in this step."""
        self.kvbridge_payloads.add_step_output(request_id, outputs, num_tokens=num_tokens)

    def kvbridge_fail_capture(self, request_id: str, reason: str) -> None:
        """Stop capturing ``request_id`` and fail its payload with ``reason`` (its receivers
        hear an abort at once; nothing partial is ever put)."""
        self.kvbridge_payloads.fail_capture(request_id, reason)

    def kvbridge_expect_payload(
        self,
        request_id: str,
        from_stage: int | str | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Start receiving ``request_id`` in the background (rank 0; a no-op on other ranks)."""
        self.kvbridge_payloads.expect(request_id, from_stage, metadata=metadata)

    def kvbridge_get_payload(
        self, request_id: str, from_stage: int | str | None = None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Wait for an expected payload; every TP rank gets it (collective when TP > 1)."""
        return self.kvbridge_payloads.get(request_id, from_stage, timeout=timeout)
