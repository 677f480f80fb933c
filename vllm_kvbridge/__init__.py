"""vllm-kvbridge: move KV caches and stage payloads between the stages of vLLM pipelines."""

from vllm_kvbridge.errors import (
    ConfigError,
    ConnectorClosed,
    KVBridgeError,
    PayloadError,
    TransferCorrupt,
    TransferError,
    TransferRefused,
    TransferTimeout,
)
from vllm_kvbridge.logs import configure_logging

__version__ = "0.1.0"

configure_logging()

__all__ = [
    "ConfigError",
    "ConnectorClosed",
    "KVBridgeError",
    "PayloadError",
    "TransferCorrupt",
    "TransferError",
    "TransferRefused",
    "TransferTimeout",
    "__version__",
]
