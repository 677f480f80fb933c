"""Pluggable transports. See :mod:`vllm_kvbridge.connectors.base` for the contract."""

from vllm_kvbridge.connectors.base import Connector, ConnectorStats, PutResult
from vllm_kvbridge.connectors.keys import TransferKey, encode_request_id, kv_key, parse_key, payload_key
from vllm_kvbridge.connectors.registry import (
    available_connectors,
    create_connector,
    get_connector_factory,
    register_connector,
)

__all__ = [
    "Connector",
    "ConnectorStats",
    "PutResult",
    "TransferKey",
    "available_connectors",
    "create_connector",
    "encode_request_id",
    "get_connector_factory",
    "kv_key",
    "parse_key",
    "payload_key",
    "register_connector",
]
