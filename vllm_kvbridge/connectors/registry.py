"""Connectors by name.

Built-in connectors are registered as ``"module:Class"`` strings and imported on first
use, so importing :mod:`vllm_kvbridge.connectors` never pulls in pyzmq or Mooncake.
Third-party connectors register themselves through the ``vllm_kvbridge.connectors``
entry-point group (``name = "pkg.module:Factory"``) or by calling
:func:`register_connector`. An import error of a connector module surfaces as itself.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.errors import ConfigError

ConnectorFactory = Callable[[Mapping[str, Any]], Connector]

ENTRY_POINT_GROUP = "vllm_kvbridge.connectors"

_BUILTINS: dict[str, str] = {
    "SharedMemoryConnector": "vllm_kvbridge.connectors.shm:SharedMemoryConnector",
    "ZmqConnector": "vllm_kvbridge.connectors.zmq_p2p:ZmqConnector",
    "MooncakeStoreConnector": "vllm_kvbridge.connectors.mooncake_store:MooncakeStoreConnector",
    "NixlConnector": "vllm_kvbridge.connectors.nixl:NixlConnector",
    "MooncakeTransferEngineConnector": "vllm_kvbridge.connectors.mooncake_te:MooncakeTransferEngineConnector",
    "CudaIpcConnector": "vllm_kvbridge.connectors.cuda_ipc:CudaIpcConnector",
    # an edge end whose peer replicas need different connectors (pipeline/placement.py)
    "RoutedConnector": "vllm_kvbridge.connectors.routed:RoutedConnector",
}
#: Short spellings accepted in stage configs.
_ALIASES: dict[str, str] = {
    "shm": "SharedMemoryConnector",
    "zmq": "ZmqConnector",
    "mooncake": "MooncakeStoreConnector",
    "nixl": "NixlConnector",
    "mooncake-te": "MooncakeTransferEngineConnector",
    "cuda_ipc": "CudaIpcConnector",
}

_lock = threading.Lock()
_factories: dict[str, ConnectorFactory | str] = dict(_BUILTINS)
_entry_points_loaded = False


def register_connector(name: str, factory: ConnectorFactory | str, *, replace: bool = False) -> None:
    """Register ``factory`` (a callable taking the config dict, or ``"module:attr"``)."""
    with _lock:
        if name in _factories and not replace:
            raise ConfigError(f"connector {name!r} is already registered")
        _factories[name] = factory


def _load_entry_points() -> None:
    global _entry_points_loaded
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _factories.setdefault(ep.name, ep.value)


def canonical_name(name: str) -> str:
    return _ALIASES.get(name, name)


def available_connectors() -> list[str]:
    _load_entry_points()
    with _lock:
        return sorted(_factories)


def _resolve(ref: ConnectorFactory | str) -> ConnectorFactory:
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)  # ImportError propagates unchanged
    return getattr(module, attr)


def get_connector_factory(name: str) -> ConnectorFactory:
    _load_entry_points()
    key = canonical_name(name)
    with _lock:
        ref = _factories.get(key)
    if ref is None:
        known = ", ".join(available_connectors())
        raise ConfigError(f"unknown connector {name!r} (known: {known})")
    factory = _resolve(ref)
    with _lock:
        _factories[key] = factory
    return factory


def create_connector(name: str, config: Mapping[str, Any] | None = None, *, rank: int = 0) -> Connector:
    """Instantiate the connector registered under ``name`` with ``config`` (as TP rank
    ``rank`` of its stage sees it: :meth:`Connector.config_for_rank`)."""
    factory = get_connector_factory(name)
    config = dict(config or {})
    for_rank = getattr(factory, "config_for_rank", None)
    if rank and for_rank is not None:
        config = for_rank(config, rank)
    connector = factory(config)
    if not isinstance(connector, Connector):
        raise ConfigError(f"connector factory {name!r} returned {type(connector).__name__}, not a Connector")
    return connector
