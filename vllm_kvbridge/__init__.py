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

__version__ = "0.1.0"

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
