"""Connector factories for the shared contract suite (``tests/test_connector_contract.py``).

A new connector joins the suite by appending a :class:`ConnectorSpec` to
:data:`CONNECTOR_SPECS` (e.g. Mooncake: a ``config`` that points at the test master and a
``leftovers`` that lists its store keys). Functions here also run in ``spawn`` children,
so they take only plain, picklable arguments.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from mooncake_fixtures import env_config, keys_in_env_master, mooncake_master  # noqa: F401 - fixture

from vllm_kvbridge.connectors import Connector, create_connector, payload_key
from vllm_kvbridge.connectors.shm_segments import PREFIX, SHM_DIR


@dataclass(frozen=True)
class ConnectorSpec:
    """How to build a connector for tests: ``config(token)`` gets a per-test unique token."""

    name: str
    config: Callable[[str], dict[str, Any]]
    #: Names of resources the connector left behind for ``token`` (must be empty after close).
    leftovers: Callable[[str], list[str]] = field(default=lambda token: [])
    #: Fixtures the connector needs running first (e.g. a Mooncake master).
    fixtures: tuple[str, ...] = ()

    def make(self, token: str, **overrides: Any) -> Connector:
        return create_connector(self.name, {**self.config(token), **overrides})


def _shm_leftovers(token: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}.{token}."))


CONNECTOR_SPECS = [
    ConnectorSpec("SharedMemoryConnector", lambda token: {"namespace": token}, _shm_leftovers),
    ConnectorSpec("ZmqConnector", lambda token: {"host": "127.0.0.1", "port": 0}),
    # A real mooncake_master per test; its address reaches spawned children through the env.
    ConnectorSpec(
        "MooncakeStoreConnector",
        env_config,
        lambda token: keys_in_env_master(f"{token}/"),
        fixtures=("mooncake_master",),
    ),
    # Real transfer engines (TCP on loopback); the engine's port and threads go with close().
    ConnectorSpec(
        "MooncakeTransferEngineConnector", lambda token: {"local_hostname": "127.0.0.1", "protocol": "tcp"}
    ),
    # NIXL over UCX (tcp/cma on loopback); registrations live in the process, checked
    # through health() by tests/test_connector_nixl.py.
    ConnectorSpec("NixlConnector", lambda token: {"host": "127.0.0.1", "port": 0}),
    # CUDA IPC between GPU processes (control messages on shared memory): only where CUDA
    # exists; without it the connector refuses to start (tests/test_cuda_ipc.py).
    *(
        [ConnectorSpec("CudaIpcConnector", lambda token: {"namespace": token}, _shm_leftovers)]
        if torch.cuda.is_available()
        else []
    ),
]
SPECS_BY_NAME = {spec.name: spec for spec in CONNECTOR_SPECS}


@pytest.fixture(params=CONNECTOR_SPECS, ids=lambda spec: spec.name)
def spec(request: pytest.FixtureRequest) -> ConnectorSpec:
    for name in request.param.fixtures:
        request.getfixturevalue(name)
    return request.param


@pytest.fixture
def token() -> str:
    """Unique per test, so concurrent test runs on the same host never share names."""
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
def pair(spec: ConnectorSpec, token: str):
    """(sender, receiver) connectors of ``spec``; closed after the test, leftovers checked."""
    sender, receiver = spec.make(token), spec.make(token)
    try:
        yield sender, receiver
    finally:
        receiver.close()
        sender.close()
    assert spec.leftovers(token) == []


def key(i: int | str = 0, chunk: int | None = None) -> str:
    return payload_key(f"req{i}", 0, 1, chunk=chunk)


def make_payload(seed: int, nbytes: int = 1 << 16) -> dict[str, Any]:
    """A KV-ish payload, deterministic in ``seed`` (children rebuild it to compare)."""
    gen = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4)
    return {
        "key_cache": [torch.randn(n // 2, generator=gen), None],
        "value_cache": [torch.randn(n - n // 2, generator=gen).to(torch.bfloat16), None],
        "ids": torch.arange(seed, seed + 7, dtype=torch.int64),
        "meta": {"seed": seed, "name": f"p{seed}", "ok": True, "blob": b"\x00\x01"},
    }


def same(a: Any, b: Any) -> bool:
    """Deep, bit-exact equality of payloads (tensors and arrays compared byte for byte)."""
    from vllm_kvbridge.wire import tensors_bitwise_equal

    if isinstance(a, torch.Tensor | np.ndarray) or isinstance(b, torch.Tensor | np.ndarray):
        return tensors_bitwise_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def deadline(seconds: float) -> float:
    return time.monotonic() + seconds


# -- spawn-process helpers (plain arguments only) -------------------------------------
def child_get(spec_name: str, token: str, k: str, metadata: dict, seed: int, nbytes: int, out) -> None:
    """Receiver in another process: get ``k`` and report whether it equals the payload."""
    with SPECS_BY_NAME[spec_name].make(token) as conn:
        got = conn.get(0, 1, k, metadata, deadline=deadline(30))
        out.put(("ok", same(got, make_payload(seed, nbytes))))


def child_put(spec_name: str, token: str, k: str, seed: int, nbytes: int, out, done, crash: bool) -> None:
    """Sender in another process: put ``k``, report the metadata, wait for ``done``
    (or crash at once without closing anything when ``crash``)."""
    conn = SPECS_BY_NAME[spec_name].make(token)
    result = conn.put(0, 1, k, make_payload(seed, nbytes))
    out.put((result.ok, result.metadata))
    if crash:
        out.close()
        out.join_thread()  # flush the queue's feeder thread, then die without cleanup
        os._exit(3)
    done.wait(60)
    conn.close()
