"""Fault injection for KV-sending LLM stages, usable as ``worker_cls`` in a stage config.

``kv_fault_fixtures.FaultyKVWorker`` is the kvbridge CPU worker whose KV sender puts
through the stage's real connector, except that:

* the KV puts of the requests named in ``KVB_TEST_REFUSE_KV`` (comma-separated transfer
  ids) are refused, as a full store or a dead peer would refuse them;
* the first transfer-status query for a request named in ``KVB_TEST_LATE_STATUS`` answers
  "unknown", as when vLLM runs the status RPC before the step that gathers an ``on_finish``
  send (the worker has not heard of the send yet).

The stage process imports this module by its dotted path, so ``tests/`` must be on the
stage's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_kvbridge.connectors.base import Connector, PutResult
from vllm_kvbridge.connectors.keys import encode_request_id
from vllm_kvbridge.runner.ar_runner import KVBridgeCPUModelRunner
from vllm_kvbridge.runner.worker import KVBridgeCPUWorker


def _ids(var: str) -> set[str]:
    return {i for i in os.environ.get(var, "").split(",") if i}


class WrappedConnector(Connector):
    """A stage's real connector behind a wrapper whose ``put`` a fault injector overrides."""

    name = "WrappedConnector"

    def __init__(self, inner: Connector) -> None:
        super().__init__({})
        self.inner = inner

    def put(self, from_stage: Any, to_stage: Any, key: str, payload: Any) -> PutResult:
        return self.inner.put(from_stage, to_stage, key, payload)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.get(*args, **kwargs)

    def cleanup(self, key: str) -> None:
        self.inner.cleanup(key)

    def health(self) -> dict[str, Any]:
        return self.inner.health()

    def _close(self) -> None:
        self.inner.close()


class WrappedKVConnectorRunner(KVBridgeCPUModelRunner):
    """The kvbridge CPU runner whose KV connector's sender puts through ``wrap(real connector)``."""

    def wrap(self, inner: Connector) -> Connector:
        return WrappedConnector(inner)

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        # vLLM created the connector just before; it builds its sender when the caches
        # are registered, inside super().
        get_kv_transfer_group().connector_worker.wrap_transport = self.wrap
        super().initialize_kv_cache(*args, **kwargs)


class RefuseKVPuts(WrappedConnector):
    name = "RefuseKVPuts"

    def __init__(self, inner: Connector, refused: set[str]) -> None:
        super().__init__(inner)
        self.refused = {f".{encode_request_id(rid)}." for rid in refused}

    def put(self, from_stage: Any, to_stage: Any, key: str, payload: Any) -> PutResult:
        if any(part in key for part in self.refused):
            return PutResult(ok=False, error="injected: the store refused the KV")
        return super().put(from_stage, to_stage, key, payload)


class FaultyKVRunner(WrappedKVConnectorRunner):
    _late_answered: set[str] = set()

    def wrap(self, inner: Connector) -> Connector:
        return RefuseKVPuts(inner, _ids("KVB_TEST_REFUSE_KV"))

    def kvbridge_transfer_status(self, request_ids: Any = None) -> dict[str, dict[str, str]]:
        out = super().kvbridge_transfer_status(request_ids)
        for rid in list(out):
            if rid in _ids("KVB_TEST_LATE_STATUS") and rid not in self._late_answered:
                self._late_answered.add(rid)
                out[rid] = {"kv": "unknown", "payload": "unknown", "aborted": "false"}
        return out


class FaultyKVWorker(KVBridgeCPUWorker):
    runner_cls = FaultyKVRunner
