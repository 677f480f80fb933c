"""KV caches between stages: gather/scatter (``layout``), TP routing (``topology``), and the
per-rank :class:`KVTransferManager` (``manager``, built from ``send``, ``receive``, ``cfg``,
``distribution``, ``prefetch`` and ``sender_info``).

``from vllm_kvbridge.kv import KVTransferManager`` imports the manager (and torch) on first
use only, so ``vllm_kvbridge.kv.config`` stays cheap to import for the config layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.manager import KVPrefetchConsumeError, KVTransferManager, ReceivedKV

__all__ = ["KVPrefetchConsumeError", "KVTransferConfig", "KVTransferManager", "ReceivedKV"]


def __getattr__(name: str) -> Any:
    if name == "KVTransferConfig":
        from vllm_kvbridge.kv.config import KVTransferConfig

        return KVTransferConfig
    if name in ("KVPrefetchConsumeError", "KVTransferManager", "ReceivedKV"):
        from vllm_kvbridge.kv import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
