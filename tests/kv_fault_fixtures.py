"""Fault injection for KV-sending LLM stages, usable as ``worker_cls`` in a stage config.

``kv_fault_fixtures.FaultyKVWorker`` is the kvbridge CPU worker whose KV sender puts
through the stage's real connector, except that:

* the KV puts of the requests named in ``KVB_TEST_REFUSE_KV`` (comma-separated transfer
  ids) are refused, as a full store or a dead peer would refuse them;
* the first transfer-status query for a request named in ``KVB_TEST_LATE_STATUS`` answers
  "unknown", as when vLLM runs the status RPC before the step that gathers an ``on_finish``
  send (the worker has not heard of the send yet).

``kv_fault_fixtures.StallPayloadWorker`` is the kvbridge CPU worker whose async-chunk
payload streams go through the stage's real connector, except that the stream of each
request named in ``KVB_TEST_STALL_PAYLOAD`` stops after its first chunk: its later chunks
and its end are never put (reported as put, as a producer that hangs or loses them would
never say), so its consumer hears nothing more, as from a stalled producer.

The stage process imports this module by its dotted path, so ``tests/`` must be on the
stage's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_kvbridge.connectors.base import Connector, PutResult
from vllm_kvbridge.connectors.keys import encode_request_id, parse_key
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

    def receiver_metadata(self) -> dict[str, Any]:
        return self.inner.receiver_metadata()

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


class StallPayloadStream(WrappedConnector):
    """Puts a named request's first chunk and drops the rest of its stream (see above)."""

    name = "StallPayloadStream"

    def __init__(self, inner: Connector, stalled: set[str]) -> None:
        super().__init__(inner)
        self.stalled = {encode_request_id(rid) for rid in stalled}

    def put(self, from_stage: Any, to_stage: Any, key: str, payload: Any) -> PutResult:
        parts = parse_key(key)
        chunk = parts["chunk"]
        if parts["rid"] in self.stalled and chunk is not None and int(chunk) > 0:
            return PutResult(ok=True)
        return super().put(from_stage, to_stage, key, payload)


class StallPayloadRunner(KVBridgeCPUModelRunner):
    """The kvbridge CPU runner whose outgoing payload connectors are :class:`StallPayloadStream`."""

    def __init__(self, vllm_config: Any, device: Any) -> None:
        super().__init__(vllm_config, device)
        runtime = self.kvbridge_runtime
        make = runtime.connector

        def connector(role: str, peer: Any, name: str, config: Any) -> Connector:
            conn = make(role, peer, name, config)  # the real one, created once and cached
            if role != "out" or isinstance(conn, StallPayloadStream):
                return conn
            wrapped = StallPayloadStream(conn, _ids("KVB_TEST_STALL_PAYLOAD"))
            with runtime.lock:  # cached in its place: closed (with the real one) at shutdown
                runtime.connectors[f"{role}:{peer}"] = wrapped
            return wrapped

        runtime.connector = connector  # type: ignore[method-assign]


class StallPayloadWorker(KVBridgeCPUWorker):
    runner_cls = StallPayloadRunner
