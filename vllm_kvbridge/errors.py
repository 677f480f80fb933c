"""The exception hierarchy shared by every layer.

Each layer raises the narrowest class that fits, so callers can tell a malformed
payload (never worth retrying) from a transport failure (maybe worth retrying) from
a configuration mistake (fix the YAML).
"""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base class of every error vllm-kvbridge raises on purpose."""


class ConfigError(KVBridgeError, ValueError):
    """A stage config, connector config or argument is invalid.

    The message names the offending key path, e.g. ``stages[1].kv_transfer.trigger``.
    """


class PayloadError(KVBridgeError, ValueError):
    """Bytes that claim to be a payload (a KV cache included) are malformed or exceed limits."""


class TransferError(KVBridgeError):
    """A transfer failed for a reason other than "not there yet"."""


class TransferTimeout(TransferError, TimeoutError):
    """The deadline passed before the data arrived."""


class TransferCorrupt(TransferError):
    """Data arrived but does not decode (wrapped PayloadError, size mismatch, ...)."""


class TransferRefused(TransferError):
    """The transport or the peer refused the operation (too big, unauthenticated, closed)."""


class ConnectorClosed(TransferRefused):
    """The connector was used after ``close()``."""


class RequestRejected(KVBridgeError):
    """A stage refused one request for a reason of the request's own (a prompt longer than
    ``max_model_len``, invalid sampling parameters): that request fails, the stage goes on."""


class RequestCancelled(KVBridgeError):
    """Work on a request stopped early because it was aborted (nobody waits for its result)."""


class ReceiveWithdrawn(TransferError):
    """The consumer gave up receiving a request (its producer was lost with the unread
    data): the receive stops within one slice instead of waiting for ``recv_timeout``."""
