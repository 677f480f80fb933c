"""Mooncake store set-up, return codes and placement, for :mod:`~vllm_kvbridge.connectors.mooncake_store`.

:func:`setup_store` runs Mooncake's ``setup`` after checks that make a dead master fail
fast; the return-code table names Mooncake's errors and says which are transient;
:func:`replicate_configs` and :func:`put_placed` keep a hard pin only for objects in the
client's own segment (see below); :func:`read_object` reads one object.

Pinning (``pin``): ``hard`` (default) means the master never evicts the object, so an
unread payload is never lost and a full store refuses puts (our TTL reaper and ``close``
remove what the receiver never read). A hard pin is kept only for objects in this
client's own segment: when a sender dies, the master drops its segment (after
``--client_ttl``) and those objects with it, but a hard-pinned object in *another*
client's segment would outlive a killed sender forever. So a put that Mooncake placed
elsewhere (the own segment was full) is stored again soft-pinned for ``soft_pin_ttl_ms``
(counted as ``spilled``), and a client without a segment of its own (or with
``prefer_local_segment: false``) soft-pins every object; ``soft`` (for ``soft_pin_ttl_ms``, default ``ttl_s``)
only makes the object evicted after unpinned ones, and a master started with
``--allow_evict_soft_pinned_objects=true`` (its default) does evict it under pressure
(seen here: a full store evicted an unread soft-pinned payload); ``none`` lets Mooncake
evict an unread object once its lease (``--default_kv_lease_ttl``) expired.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vllm_kvbridge.connectors.claim_loop import MISSING, Retry
from vllm_kvbridge.connectors.registered_pool import RegisteredBufferPool
from vllm_kvbridge.errors import ConfigError, TransferError, TransferTimeout

logger = logging.getLogger(__name__)

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


def put_error(code: int, key: str, nbytes: int, master: str) -> str:
    """The ``PutResult.error`` of a put that failed with Mooncake ``code``."""
    if code == OBJECT_ALREADY_EXISTS:
        return f"key {key!r} already exists in the Mooncake store"
    if code == NO_AVAILABLE_HANDLE:
        return (
            f"Mooncake store full: no segment has room for {nbytes} bytes "
            f"(grow global_segment_size or consume/clean up keys)"
        )
    if code in TRANSIENT:
        return f"Mooncake put of {key!r} failed ({error_name(code)}) after retries; master {master}"
    return f"Mooncake put of {key!r} failed: {error_name(code)}"


def retry_transient(
    store: Any,
    op: Callable[[], int],
    backoff_s: float,
    max_retries: int,
    master_retry_s: float,
    closed: Callable[[], bool],
) -> int:
    """Run ``op`` (returns a Mooncake code), retrying transient codes with backoff.

    While the master is unreachable no operation is attempted (a transfer against a dead
    master takes seconds to fail): it waits up to ``master_retry_s`` for the master, then
    gives up with RPC_FAIL.
    """
    start = time.monotonic()
    delay = backoff_s
    attempt = 0
    while True:
        while store.health_check() == MASTER_UNREACHABLE:
            if time.monotonic() - start >= master_retry_s or closed():
                return RPC_FAIL
            time.sleep(min(delay, 0.2))
        code = op()
        if code not in TRANSIENT or attempt >= max_retries or closed():
            return code
        attempt += 1
        time.sleep(delay)
        delay *= 2


@dataclass(frozen=True)
class GetPolicy:
    """How a get rides out transient errors: ``backoff_s`` (first retry delay),
    ``master_retry_s`` (how long it waits for the master), ``master`` (for messages) and
    ``master_down`` (whether the master is unreachable now)."""

    backoff_s: float
    master_retry_s: float
    master: str
    master_down: Callable[[], bool]


def get_retry(code: int, store_key: str, waited: float, late: bool, policy: GetPolicy) -> Retry:
    """The claim loop's answer to a get of ``store_key`` that met ``code`` (not found, or
    transient for ``waited`` seconds; ``late``: its deadline passed), or the error that ends it."""
    if code == OBJECT_NOT_FOUND:
        return MISSING
    if code not in TRANSIENT:
        raise TransferError(f"Mooncake get of {store_key!r} failed: {error_name(code)}")
    if waited < policy.master_retry_s and late:
        # e.g. REPLICA_IS_NOT_READY: a put of it is under way. Within master_retry_s that
        # is "not there yet", which a caller polling in short slices (the KV manager) asks
        # again for.
        raise TransferTimeout(
            f"{store_key!r} was not readable before the deadline ({error_name(code)}); master {policy.master}"
        )
    if waited >= policy.master_retry_s or late:
        why = "the master is unreachable" if policy.master_down() else "transient errors"
        raise TransferError(
            f"Mooncake get of {store_key!r} failed ({error_name(code)}): {why} "
            f"for {waited:.1f} s; master {policy.master}"
        )
    return Retry(floor=policy.backoff_s, cap=0.5, always=True)  # retried, deadline or not


def remove_keys(store: Any, keys: list[str]) -> None:
    """Remove ``keys`` (``force``: past any lease), each the batch could not once more."""
    for key, code in zip(keys, store.batch_remove(keys, True)):
        if code not in (OK, OBJECT_NOT_FOUND):
            store.remove(key, True)


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


# -- placement and reads ----------------------------------------------------------------
def replicate_configs(pin: str, soft_pin_ttl_ms: int, segment: str | None) -> tuple[Any, Any]:
    """``(config puts use for pin, config a misplaced hard-pinned put is stored again with)``.

    A hard pin only where the object goes with this client (its own ``segment``); without
    one (None), objects always land elsewhere: soft-pinned. The second is None when no
    put is ever stored again (no hard pin).
    """
    from mooncake.store import ReplicateConfig, SoftPinAction

    soft, hard = ReplicateConfig(), ReplicateConfig()
    soft.soft_pin_action, soft.soft_pin_ttl_ms = SoftPinAction.ENABLE, soft_pin_ttl_ms
    hard.with_hard_pin = True
    configs = {"none": ReplicateConfig(), "soft": soft, "hard": hard if segment else soft}
    if segment:
        for rc in configs.values():
            rc.preferred_segment = segment
    return configs[pin], (soft if configs[pin] is hard else None)


def put_placed(
    store: Any,
    store_key: str,
    put: Callable[[Any], int],
    configs: tuple[Any, Any],
    hostname: str,
    retrying: Callable[[Callable[[], int]], int],
) -> tuple[int, bool]:
    """``(code, spilled)`` of ``put(configs[0])`` (through ``retrying``); a hard-pinned object
    that Mooncake placed in another client's segment is stored again with ``configs[1]``."""
    replicate, spill = configs
    code = retrying(lambda: put(replicate))
    if code != OK or spill is None or placed_here(store, store_key, hostname):
        return code, False
    # Forced: a fresh put holds a lease. Nobody has the put metadata yet; a receiver
    # polling for the key that read it meanwhile removed it (then it is delivered).
    if store.remove(store_key, True) != OK:
        return OK, False
    return retrying(lambda: put(spill)), True


def placed_here(store: Any, store_key: str, hostname: str) -> bool:
    """Whether every memory replica of ``store_key`` lives in the segment of ``hostname``."""
    try:
        replicas = store.get_replica_desc(store_key)
        return all(
            r.get_memory_descriptor().buffer_descriptor.transport_endpoint == hostname
            for r in replicas
            if r.is_memory_replica()
        )
    except Exception as exc:  # cannot tell: keep the hard pin (the TTL reaper still runs)
        logger.warning("Mooncake placement of %s unknown (%s): kept hard-pinned", store_key, exc)
        return True


def read_object(
    store: Any, store_key: str, size: int, pool: RegisteredBufferPool | None
) -> tuple[Any | None, int]:
    """``(buffer, OK)`` or ``(None, code)``. With a ``pool`` (zero copy) the object lands in
    one of its registered slabs and the buffer is a view of it that gives the slab back once
    it (and every tensor decoded over it) is gone; without, Mooncake's bytes ``get``."""
    if pool is None:
        data = store.get(store_key)
        if len(data) != size:
            return None, OBJECT_NOT_FOUND if not data else TRANSFER_FAIL
        return data, OK
    # A pooled slab, not a fresh buffer per object: registering one per transfer, and above
    # all faulting in its pages while the transfer engine writes it, made a 64 MB get 4-5x
    # slower than Mooncake's own (issue 37). A slab comes back when the decoded tensors die.
    slab, _ = pool.acquire(size)
    try:
        got = store.get_into(store_key, slab.ctypes.data, size)
    except BaseException:
        pool.release(slab)
        raise
    if got == size:
        return pool.lend_view(slab, size), OK
    pool.release(slab)
    if got >= 0:  # the object changed size between get_size and get_into
        return None, TRANSFER_FAIL
    return None, got
