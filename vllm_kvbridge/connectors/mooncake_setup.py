"""Mooncake store set-up and return codes, for :mod:`~vllm_kvbridge.connectors.mooncake_store`.

:func:`setup_store` runs Mooncake's ``setup`` after checks that make a dead master fail
fast; the return-code table names Mooncake's errors and says which are transient.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from typing import Any
from urllib.parse import urlsplit

from vllm_kvbridge.errors import ConfigError, TransferError

# Mooncake store error codes (mooncake-store/include/types.h).
OK = 0
NO_AVAILABLE_HANDLE = -200  # no space in any segment: the store is full
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
_ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (store full)",
    INVALID_PARAMS: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    REPLICA_IS_NOT_READY: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -712: "REPLICA_IS_GONE",
    -714: "REPLICA_BUSY",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL (master unreachable)",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
#: Worth retrying: the master or a peer is briefly unavailable, or a replica is mid-write.
TRANSIENT = frozenset({REPLICA_IS_NOT_READY, -714, TRANSFER_FAIL, RPC_FAIL, -901, -1010})
#: ``health_check()``: 0 healthy, 1 not initialised/closed, 2 master unreachable.
MASTER_UNREACHABLE = 2

#: Run by ``setup_check: subprocess`` in a child: a client without a segment sets up and leaves.
_SETUP_CHECK = """
import sys
from mooncake.store import MooncakeDistributedStore
host, metadata, protocol, devices, master = sys.argv[1:6]
store = MooncakeDistributedStore()
rc = store.setup(host, metadata, 0, 1 << 20, protocol, devices, master)
store.close()
sys.exit(0 if rc == 0 else 3)
"""


def error_name(code: int) -> str:
    """``"-704 OBJECT_NOT_FOUND"`` for a Mooncake return code."""
    return f"{code} {_ERROR_NAMES.get(code, 'UNKNOWN')}"


def host_port(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{what} must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def probe(host: str, port: int, timeout: float, what: str) -> None:
    """Fail fast (TransferError) when nothing accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise TransferError(f"{what} at {host}:{port} is unreachable: {exc}") from None


def setup_store(
    store: Any,
    *,
    local_hostname: str,
    metadata_server: str,
    master_server_address: str,
    global_segment_size: int,
    local_buffer_size: int,
    protocol: str,
    device_name: str,
    connect_timeout_s: float,
    setup_check: str,
) -> None:
    """Mooncake ``setup`` of ``store``, after checks that make a dead master fail fast.

    ``setup`` holds the GIL and retries for ~90 s when the master is down (forever when
    something silent listens on the port), so it cannot be bounded by a thread. Before
    it: the master and HTTP metadata ports are probed (``setup_check: port``, default),
    and with ``setup_check: subprocess`` a throw-away client runs ``setup`` in a child
    process killed after ``connect_timeout_s`` (costs ~1 s; catches a port that
    accepts connections but is not a working Mooncake master). :class:`TransferError`
    names what failed.
    """
    master_host, master_port = host_port(master_server_address, "master_server_address")
    probe_timeout = max(0.1, min(2.0, connect_timeout_s))
    probe(master_host, master_port, probe_timeout, "Mooncake master")
    url = urlsplit(metadata_server)
    if url.scheme in ("http", "https") and url.hostname:
        probe(
            url.hostname,
            url.port or (443 if url.scheme == "https" else 80),
            probe_timeout,
            "Mooncake HTTP metadata server",
        )
    where = (
        f"master {master_server_address}, metadata server {metadata_server}, "
        f"local hostname {local_hostname}, protocol {protocol}"
    )
    if setup_check == "subprocess":
        host = local_hostname.rpartition(":")[0] if ":" in local_hostname else local_hostname
        _setup_in_child(
            [host, metadata_server, protocol, device_name, master_server_address], connect_timeout_s, where
        )
    rc = store.setup(
        local_hostname,
        metadata_server,
        global_segment_size,
        local_buffer_size,
        protocol,
        device_name,
        master_server_address,
    )
    if rc != OK:
        raise TransferError(f"Mooncake setup failed with rc={rc} ({where})")


def _setup_in_child(args: list[str], timeout_s: float, where: str) -> None:
    try:
        child = subprocess.run(
            [sys.executable, "-c", _SETUP_CHECK, *args],
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise TransferError(
            f"Mooncake setup did not finish within connect_timeout_s={timeout_s} ({where})"
        ) from None
    if child.returncode != 0:
        tail = child.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise TransferError(
            f"Mooncake setup check failed (exit {child.returncode}, {where}): " + " | ".join(tail)
        )
