"""Cross-host transport through Mooncake's distributed store (``mooncake_master``).

Topology: one ``mooncake_master`` (with its HTTP metadata server, or etcd) serves the
object metadata; every connector is a Mooncake store client that may contribute a slice of
its own memory (``global_segment_size``) to the distributed pool. Bytes move between
clients over the transfer engine (``protocol: tcp`` or ``rdma``).

Sender: :meth:`~MooncakeStoreConnector.reserve` lends a *registered* staging buffer from a
small pool; the packed payload is written into it once (a put encodes and packs it; the KV
sender gathers straight into it) and publishing stores it with ``put_from`` (the transfer
engine reads the registered buffer directly; no copy into Mooncake's own local buffer). By default the
object is placed in this client's own segment (``prefer_local_segment``), so the put is a
local write and the receiver pulls one hop. ``PutResult.metadata`` carries the store
``namespace``, the object's ``key`` and ``nbytes`` and the ``master`` address.

Receiver (:meth:`MooncakeStoreConnector.get`): ``get_size`` (cheap master RPC; also the
"not there yet" poll, in the one claim loop :mod:`~vllm_kvbridge.connectors.claim_loop`)
then ``get_into`` a registered slab of the same pool, then
:func:`vllm_kvbridge.wire.decode_packed` over it without a copy. The returned tensors are
views of the slab; it goes back to the pool when the last of them is freed (until then
it is lent; beyond ``buffer_pool_bytes`` of slabs, one is unregistered and freed instead).
Reusing slabs matters: a fresh buffer per get, registered and faulted in while the
transfer engine wrote it, made a 64 MB get 4x slower than Mooncake's own. The object is
removed from the store once read (destructive: of two receivers that read it, the one
whose removal found it returns it).

Lifetime of store keys (nothing is left in the store after a run):
  * a key is removed by the receiver once read; ``cleanup(key)`` removes it from either side;
  * the sender tracks what it put (the one held table, :mod:`~vllm_kvbridge.connectors.held_table`):
    keys not consumed within ``ttl_s`` are removed by a reaper thread (counted as
    ``expired``), and ``close()`` removes every key it still tracks;
    a receiver's :meth:`~MooncakeStoreConnector.renew` (``RENEW`` to the sender's control
    server, :mod:`~vllm_kvbridge.connectors.te_control`, at ``metadata["control"]``) moves
    a tracked key's expiry to ``lease_s`` from then;
  * a receiver that could not remove a key it read retries on every sweep and at close.

Pinning (``pin``: ``hard``, the default, ``soft`` or ``none``): a hard pin is kept only for
objects in this client's own segment, see :mod:`~vllm_kvbridge.connectors.mooncake_setup`.

Failures:
  * master or metadata server unreachable at construction: :class:`TransferError` within
    ``connect_timeout_s`` (their ports are probed before Mooncake's ``setup``, which holds
    the GIL and retries for ~90 s; ``setup_check: subprocess`` also bounds a port that
    accepts connections but never answers, see :func:`~vllm_kvbridge.connectors.mooncake_setup.setup_store`);
  * transient errors (RPC failure, transfer failure, replica not ready) are retried with
    exponential backoff; while the master is unreachable an operation waits at most
    ``master_retry_s`` for it to come back, then ``put`` returns ``ok=False`` and ``get``
    raises :class:`TransferError` naming the master. A client reconnects by itself when
    the master returns (objects stored before a master restart are gone);
  * store full / key already stored / payload too big: ``put`` returns ``ok=False`` with
    ``error`` (it never raises for transport failures, like the other connectors).

Config keys (plain values: ``${ENV}`` references in a stage config are expanded when the
config is loaded, :func:`vllm_kvbridge.config.load_spec`, not here):
  ``local_hostname`` (``127.0.0.1``; the address other clients reach this one at; without
  ``:port`` Mooncake picks a free port per client, so several connectors in one host or
  process never collide), ``metadata_server`` (``http://127.0.0.1:8080/metadata``),
  ``master_server_address`` (``127.0.0.1:50051``), ``global_segment_size`` (512 MiB; bytes
  or a string such as ``"1GiB"``; 0 for a pure consumer), ``local_buffer_size`` (16 MiB;
  only used by the bytes fallback), ``protocol`` (``tcp`` | ``rdma``), ``device_name``
  (RDMA device list, e.g. ``mlx5_0``), ``namespace`` (``kvbridge``; prefix of every store
  key), ``pin``, ``soft_pin_ttl_ms``, ``prefer_local_segment`` (true), ``ttl_s`` (300),
  ``lease_s`` (``DEFAULT_LEASE_S``), ``max_payload_bytes`` (64 GiB), ``max_retries`` (3),
  ``retry_backoff_s`` (0.05), ``master_retry_s`` (5), ``connect_timeout_s`` (10),
  ``setup_check`` (``port`` | ``subprocess``), ``buffer_pool_bytes`` (512 MiB of registered
  staging buffers kept for reuse), ``zero_copy`` (true; false forces the bytes API
  ``put``/``get``, which Mooncake copies through its local buffer), ``limits``
  (:class:`~vllm_kvbridge.wire.Limits` for decoding).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from vllm_kvbridge.connectors import te_control as ctl
from vllm_kvbridge.connectors.base import (
    DEFAULT_LEASE_S,
    Connector,
    Due,
    LentReservation,
    Meta,
    PutResult,
    Stage,
    choice_option,
    number_option,
    parse_size,
)
from vllm_kvbridge.connectors.claim_loop import claim_until_deadline
from vllm_kvbridge.connectors.held_table import HeldTable
from vllm_kvbridge.connectors.mooncake_setup import (
    MASTER_UNREACHABLE,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    TRANSIENT,
    GetPolicy,
    error_name,
    get_retry,
    host_port,
    put_error,
    put_placed,
    read_object,
    remove_keys,
    replicate_configs,
    retry_transient,
    setup_store,
)
from vllm_kvbridge.connectors.registered_pool import RegisteredBufferPool
from vllm_kvbridge.errors import (
    ConfigError,
    PayloadError,
    TransferCorrupt,
    TransferError,
    TransferRefused,
    TransferTimeout,
)

_NAMESPACE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAX_KEY = 512
_RENEW_TIMEOUT_S = 3.0  # a renewal the sender does not answer by then raises TransferError


@dataclass
class _Lent:
    """What a reservation holds: its store key, the control endpoint, and its buffer (a
    registered slab, or without zero copy a plain host buffer)."""

    store_key: str
    control: str
    slab: np.ndarray | None
    pooled: bool


class MooncakeStoreConnector(Connector):
    """Transport through a Mooncake distributed store; see the module docstring."""

    name = "MooncakeStoreConnector"
    data_outlives_sender = True  # the store (its master and segments) holds it, not the sender

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        # Everything _close() touches exists before anything can fail.
        self._store: Any = None
        self._pool: RegisteredBufferPool | None = None
        self._lock = threading.Lock()
        # Sender side: the store keys it put (and puts under way), until read, cleaned up or
        # expired; no byte budget (a full store answers full). Limits set below.
        self._table: HeldTable[None] = HeldTable(0.0, 0.0)
        self._pending_removals: set[str] = set()  # read but not yet removed (receiver side)
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self._ctx: zmq.Context | None = None  # control channel: server (sender), client (receiver)
        self._server: ctl.ControlServer | None = None
        self._client: ctl.ControlClient | None = None
        self.hostname = ""

        cfg = self.config
        self.local_hostname = str(cfg.get("local_hostname", "127.0.0.1"))
        self.metadata_server = str(cfg.get("metadata_server", "http://127.0.0.1:8080/metadata"))
        self.master_server_address = str(cfg.get("master_server_address", "127.0.0.1:50051"))
        self.global_segment_size = parse_size(
            cfg.get("global_segment_size", 512 << 20), "global_segment_size"
        )
        self.local_buffer_size = parse_size(cfg.get("local_buffer_size", 16 << 20), "local_buffer_size")
        self.protocol = choice_option(cfg, "protocol", ("tcp", "rdma"))
        self.device_name = str(cfg.get("device_name", "") or "")
        self.namespace = str(cfg.get("namespace", "kvbridge"))
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ConfigError(
                f"connector option 'namespace' must match [A-Za-z0-9_-]{{1,64}}, got {self.namespace!r}"
            )
        self.pin = choice_option(cfg, "pin", ("hard", "none", "soft"))
        self.ttl_s = number_option(cfg, "ttl_s", 300.0)
        self.lease_s = number_option(cfg, "lease_s", DEFAULT_LEASE_S)
        self._table.set_limits(self.ttl_s, self.lease_s, None)
        self.soft_pin_ttl_ms = number_option(cfg, "soft_pin_ttl_ms", max(1000, int(self.ttl_s * 1000)), int)
        self.prefer_local_segment = bool(cfg.get("prefer_local_segment", True))
        self.max_payload_bytes = parse_size(cfg.get("max_payload_bytes", 64 << 30), "max_payload_bytes")
        self.max_retries = number_option(cfg, "max_retries", 3, int)
        self.retry_backoff_s = number_option(cfg, "retry_backoff_s", 0.05)
        self.master_retry_s = number_option(cfg, "master_retry_s", 5.0)
        self.connect_timeout_s = number_option(cfg, "connect_timeout_s", 10.0)
        self.setup_check = choice_option(cfg, "setup_check", ("port", "subprocess"), lower=False)
        self.buffer_pool_bytes = parse_size(cfg.get("buffer_pool_bytes", 512 << 20), "buffer_pool_bytes")
        self._limits = cfg.get("limits")
        self._get_policy = GetPolicy(
            self.retry_backoff_s, self.master_retry_s, self.master_server_address, self._master_down
        )
        host_port(self.master_server_address, "master_server_address")  # checked before any setup

        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError(
                f"{self.name} needs Mooncake's Python binding: pip install 'vllm-kvbridge[mooncake]' ({exc})"
            ) from exc
        store = MooncakeDistributedStore()
        self.zero_copy = bool(cfg.get("zero_copy", True)) and all(
            hasattr(store, n) for n in ("put_from", "get_into", "register_buffer", "unregister_buffer")
        )

        setup_store(
            store,
            local_hostname=self.local_hostname,
            metadata_server=self.metadata_server,
            master_server_address=self.master_server_address,
            global_segment_size=self.global_segment_size,
            local_buffer_size=self.local_buffer_size,
            protocol=self.protocol,
            device_name=self.device_name,
            connect_timeout_s=self.connect_timeout_s,
            setup_check=self.setup_check,
        )
        self._store = store
        self.hostname = str(store.get_hostname())
        # A hard pin only where the object goes with this client (mooncake_setup: "Pinning").
        local = self.prefer_local_segment and self.global_segment_size > 0
        self._replicates = replicate_configs(self.pin, self.soft_pin_ttl_ms, self.hostname if local else None)
        self.stats.add(spilled=0, expired=0)  # shown in health() from the start
        if self.zero_copy:
            register = (store.register_buffer, store.unregister_buffer)
            self._pool = RegisteredBufferPool(*register, self.buffer_pool_bytes)

    # -- keys ---------------------------------------------------------------------------
    def store_key(self, key: str, namespace: str | None = None) -> str:
        """The Mooncake object key of transfer ``key`` (``<namespace>/<key>``)."""
        if not isinstance(key, str) or not key or len(key) > _MAX_KEY or not key.isascii():
            raise ConfigError(f"transfer key {key!r} must be a non-empty ASCII string of <= {_MAX_KEY} chars")
        return f"{namespace or self.namespace}/{key}"

    def _receiver_key(self, key: str, metadata: Mapping[str, Any] | None) -> str:
        namespace = (metadata or {}).get("namespace")
        if namespace is not None and (not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace)):
            raise TransferError(f"put metadata carries an invalid namespace {namespace!r}")
        return self.store_key(key, namespace)

    # -- retries ------------------------------------------------------------------------
    def _master_down(self) -> bool:
        return self._store.health_check() == MASTER_UNREACHABLE

    def _retrying(self, op: Callable[[], int]) -> int:
        """``op`` with transient codes retried, while the master is up (:func:`retry_transient`)."""
        return retry_transient(
            self._store, op, self.retry_backoff_s, self.max_retries, self.master_retry_s, lambda: self._closed
        )

    # -- sender -------------------------------------------------------------------------
    def put(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        """Store ``payload`` under ``key``; the receiver finds it with ``metadata``.

        Returns ``ok=False`` with ``error`` (never raises for transport failures) when the
        payload exceeds ``max_payload_bytes``, the key is already stored, the store is full,
        or the master stayed unreachable for ``master_retry_s``. The payload is copied:
        the caller may reuse its tensors once this returns.
        """
        self._check_open()
        self.store_key(key)
        return self._put_reserved(from_stage, to_stage, key, payload)

    def reserve(self, from_stage: Stage, to_stage: Stage, key: str, nbytes: int) -> Any:
        """A buffer registered with the store (a slab of the pool) to write a packed payload
        of ``nbytes`` into; publishing puts it from there (``put_from``, no further copy).
        See :class:`~vllm_kvbridge.connectors.base.Reservation`."""
        self._check_open()
        store_key = self.store_key(key)
        if (refused := self._refuse_oversize(nbytes)) is not None:
            return refused
        try:
            control = self._ensure_server()
        except TransferError as exc:  # cannot bind: nobody could renew the key
            return self._put_failed(str(exc))
        self._check_open()
        if (refused := self._table.reserve(store_key, nbytes)) is not None:
            return self._put_refused(refused)
        try:
            slab, pooled = self._pool.acquire(nbytes) if self._pool is not None else (None, False)
        except TransferError as exc:  # registering a new slab needs the master
            self._table.unreserve(store_key)
            if self._master_down():
                master = self.master_server_address
                return self._put_failed(
                    f"cannot register a {nbytes}-byte buffer: master {master} is unreachable"
                )
            return self._put_failed(str(exc))
        buffer = memoryview(slab)[:nbytes] if slab is not None else memoryview(bytearray(nbytes))
        return LentReservation(self, key, nbytes, buffer, _Lent(store_key, control, slab, pooled))

    def _publish_lent(self, r: LentReservation, start: float) -> PutResult:
        """Put the written buffer of ``r`` into the store (see :meth:`reserve`)."""
        lent: _Lent = r.lent
        store_key, need = lent.store_key, r.nbytes
        # Mooncake answers OK to a put of an existing key without replacing it, so ask
        # first (another client could still race us between the two calls).
        exists = self._retrying(lambda: self._store.is_exist(store_key))
        if exists == 1:
            code = OBJECT_ALREADY_EXISTS
        elif exists in TRANSIENT:  # retries exhausted: the master is away
            code = exists
        elif lent.slab is not None:
            ptr = lent.slab.ctypes.data
            code = self._put_placed(store_key, lambda rc: self._store.put_from(store_key, ptr, need, rc))
        else:  # bytes fallback: Mooncake copies through its local buffer
            data = bytes(r.buffer)
            code = self._put_placed(store_key, lambda rc: self._store.put(store_key, data, rc))
        if code != OK:
            why = put_error(code, r.key, need, self.master_server_address)
            # A full store has room again once receivers read (or leases expire): wait.
            return self._put_full(why) if code == NO_AVAILABLE_HANDLE else self._put_failed(why)
        # The store holds its own copy now: the slab goes back at once (a published
        # reservation is not released again; keeping it leaked a registered slab per put).
        if lent.slab is not None and self._pool is not None:
            self._pool.release(lent.slab)
        if self._table.publish(store_key, None):
            with self._lock:
                self._start_reaper_locked()
        else:  # close() ran meanwhile: do not leave the key behind
            self._remove(store_key)
            return self._put_failed(f"{self.name} closed during put")
        self.stats.add(puts=1, put_bytes=need, put_seconds=time.perf_counter() - start)
        return PutResult(
            ok=True,
            nbytes=need,
            metadata={
                "namespace": self.namespace,
                "key": store_key,
                "nbytes": need,
                "master": self.master_server_address,
                "control": lent.control,
                "lease_s": self.lease_s,
            },
        )

    def _release_lent(self, r: LentReservation) -> None:
        """A reservation ends unpublished: its buffer goes back (a published one's went back
        in :meth:`_publish_lent`)."""
        lent: _Lent = r.lent
        self._table.unreserve(lent.store_key)
        if lent.slab is not None and self._pool is not None:
            self._pool.release(lent.slab, lent.pooled)

    def _ensure_server(self) -> str:
        """The control endpoint receivers renew at (its server started at the first put)."""
        with self._lock:
            self._check_open()
            if self._server is None:
                host = self.local_hostname.rpartition(":")[0] or self.local_hostname
                server = ctl.ControlServer(self._context_locked(), host, 0, host, self._answer)
                server.start(lambda: None, 3600.0)  # the reaper thread sweeps, not the server
                self._server = server
            return self._server.endpoint

    def _context_locked(self) -> zmq.Context:
        if self._ctx is None:
            self._ctx = zmq.Context()
        return self._ctx

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The control server's handler (its thread): RENEW of a key this sender tracks."""
        if request[0] != ctl.RENEW or len(request) != 2:
            return [ctl.BAD]
        store_key = request[1].decode("ascii")
        tracked = self._table.get(store_key) is not None
        # A key read by its receiver stays tracked until a sweep notices: ask the store.
        if tracked and self._store.is_exist(store_key) != 0 and self._table.renew(store_key):
            return [ctl.OK]  # is_exist 1, or unknown: keep it
        return [ctl.MISSING]

    def _put_placed(self, store_key: str, put: Callable[[Any], int]) -> int:
        """``put`` with this connector's pin (a misplaced hard-pinned object is spilled)."""
        code, spilled = put_placed(
            self._store, store_key, put, self._replicates, self.hostname, self._retrying
        )
        self.stats.add(spilled=int(spilled))
        return code

    # -- receiver -----------------------------------------------------------------------
    def get(
        self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None, *, deadline: Due = None
    ) -> Any | None:
        """Read and remove ``key`` (namespace from ``metadata``, else this connector's).

        Without a deadline: one look, ``None`` if the key is not stored. With a deadline:
        polls (1 ms backoff up to 20 ms) until it appears, then raises
        :class:`TransferTimeout`. :class:`TransferError` when the master stays unreachable
        for ``master_retry_s`` (or past the deadline), :class:`TransferRefused` when the
        object exceeds ``max_payload_bytes``, :class:`TransferCorrupt` when it does not
        decode (the object is removed either way).
        """
        from vllm_kvbridge.wire import decode_packed

        self._check_open()
        store_key = self._receiver_key(key, metadata)
        start = time.perf_counter()
        try:
            buffer = self._fetch(store_key, deadline)
            if buffer is None:
                self.stats.add(get_misses=1)
                return None
            try:
                payload = decode_packed(buffer, limits=self._limits, copy=False)
            except PayloadError as exc:
                raise TransferCorrupt(f"{store_key!r} does not decode: {exc}") from exc
        except TransferTimeout:
            self.stats.add(timeouts=1)
            raise
        except TransferError:
            self.stats.add(get_failures=1)
            raise
        self.stats.add(gets=1, get_bytes=len(buffer), get_seconds=time.perf_counter() - start)
        return payload

    def _fetch(self, store_key: str, deadline: float | None) -> Any | None:
        """The object's bytes (removed from the store), or ``None`` when absent and no deadline."""
        unreachable_since: float | None = None

        def attempt(_hold: float, _wait_until: float) -> Any:
            nonlocal unreachable_since
            self._check_open()
            code = self._store.get_size(store_key)
            if code > 0:
                if code > self.max_payload_bytes:
                    self._remove(store_key)
                    raise TransferRefused(
                        f"{store_key!r} is {code} bytes, over max_payload_bytes={self.max_payload_bytes}"
                    )
                buffer, code = read_object(self._store, store_key, code, self._pool)
                if buffer is not None:
                    if self._consumed(store_key):
                        return buffer
                    code = OBJECT_NOT_FOUND  # another receiver read it too and removed it first
            elif code == 0:  # the codec never writes an empty object
                self._remove(store_key)
                raise TransferCorrupt(f"{store_key!r} is an empty object")
            now = time.monotonic()
            unreachable_since = None if code == OBJECT_NOT_FOUND else unreachable_since or now
            late = deadline is not None and now >= deadline
            return get_retry(code, store_key, now - (unreachable_since or now), late, self._get_policy)

        return claim_until_deadline(
            attempt,
            deadline,
            not_there=f"{store_key!r} did not appear in the Mooncake store "
            f"(master {self.master_server_address}) before the deadline",
            check_open=self._check_open,
        )

    def renew(self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None) -> bool:
        """Ask the sender (``metadata["control"]``) to keep ``key`` for its ``lease_s`` from now.

        False: the sender does not track the key, or ``metadata`` names no control endpoint
        (an older sender). :class:`TransferError` when the sender does not answer within
        ``_RENEW_TIMEOUT_S`` (sooner when it refuses connections: it is gone).
        """
        self._check_open()
        store_key = self._receiver_key(key, metadata)
        endpoint = (metadata or {}).get("control")
        if endpoint is None:
            return False
        if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            raise TransferError(f"put metadata carries an invalid control endpoint {endpoint!r}")
        with self._lock:
            self._check_open()
            if self._client is None:
                self._client = ctl.ControlClient(self._context_locked(), lambda: self._closed)
            client = self._client
        return client.renew(endpoint, store_key, _RENEW_TIMEOUT_S)

    # -- removal ------------------------------------------------------------------------
    def _remove(self, store_key: str) -> bool:
        """Remove an object (``force``: skip the lease a fresh put or get grants). True if gone."""
        return self._store.remove(store_key, True) in (OK, OBJECT_NOT_FOUND)

    def _consumed(self, store_key: str) -> bool:
        """Remove what a get read; False when it was gone (a read is not atomic with its
        removal: of two receivers that read one object, the removal decides who has it)."""
        self._table.drop(store_key)
        code = self._store.remove(store_key, True)
        if code == OBJECT_NOT_FOUND:
            self.stats.add(read_lost_to_another=1)
            return False
        if code != OK:  # cannot tell: keep what was read, retry the removal
            self._remove_later(store_key)
        return True

    def cleanup(self, key: str) -> None:
        """Remove ``key`` (this connector's namespace) from the store and forget it. Idempotent."""
        store_key = self.store_key(key)
        with self._lock:
            if self._store is None or self._closed:
                return
            self._pending_removals.discard(store_key)
        self._table.drop(store_key)
        if not self._remove(store_key):
            self._remove_later(store_key)
        self.stats.add(cleanups=1)

    def _remove_later(self, store_key: str) -> None:
        with self._lock:
            self._pending_removals.add(store_key)
            self._start_reaper_locked()

    def _start_reaper_locked(self) -> None:
        if self._reaper is None and not self._closed:
            self._reaper = threading.Thread(
                target=self._reap_loop, name="kvbridge-mooncake-reaper", daemon=True
            )
            self._reaper.start()

    def _reap_loop(self) -> None:
        every = max(0.05, min(self.ttl_s / 4, self.lease_s / 4, 1.0))
        while not self._stop.wait(every):
            try:
                self.sweep()
            except Exception:  # the store may be mid-close; the next sweep or close() retries
                pass

    def sweep(self) -> None:
        """Remove expired unclaimed keys, forget consumed ones, retry failed removals."""
        with self._lock:
            if self._closed or self._store is None:
                return
            retry = list(self._pending_removals)
        expired = [held.key for held in self._table.sweep()]
        if live := self._table.keys():  # forget keys consumed: no removal at close
            for k in [k for k, e in zip(live, self._store.batch_is_exist(live)) if e == 0]:
                self._table.drop(k)
        codes = [self._store.remove(k, True) for k in expired]
        self.stats.add(expired=codes.count(OK))  # OBJECT_NOT_FOUND: read meanwhile
        removed = [k for k in retry if self._remove(k)]
        failed = [k for k, c in zip(expired, codes) if c not in (OK, OBJECT_NOT_FOUND)]
        with self._lock:
            self._pending_removals.difference_update(removed)
            self._pending_removals.update(failed)  # retried with the failed removals

    # -- status / close -----------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        with self._lock:
            pending = len(self._pending_removals)
        status = {
            **super().health(),
            "master": self.master_server_address,
            "metadata_server": self.metadata_server,
            "protocol": self.protocol,
            "namespace": self.namespace,
            "zero_copy": self.zero_copy,
            "published": self._table.counts()["held"],
            "pending_removals": pending,
            "pooled_buffer_bytes": self._pool.pooled_bytes if self._pool is not None else 0,
            # slabs registered so far and lent now: a steady stream of puts or gets reuses
            # its slabs (a fresh, registered buffer per transfer was 4x slower)
            "buffer_registrations": self._pool.registrations if self._pool is not None else 0,
            "buffers_lent": self._pool.lent if self._pool is not None else 0,
        }
        store = self._store
        if store is not None and not self._closed:
            status["local_hostname"] = self.hostname
            status["master_reachable"] = reachable = store.health_check() == OK
            status["unreachable"] = int(not reachable)  # connectors.base.EDGE_COUNTERS
        return status

    def _close(self) -> None:
        self._stop.set()
        reaper = self._reaper
        if reaper is not None and reaper is not threading.current_thread():
            reaper.join(5)
        with self._lock:  # a put or renew that got past _check_open set these before
            server, client, ctx = self._server, self._client, self._ctx
        if server is not None:
            server.close()  # no renewal is answered while the keys go
        if client is not None:
            client.close()
        store = self._store
        if store is None:
            if ctx is not None:
                ctx.term()
            return
        tracked = {held.key for held in self._table.clear()}
        with self._lock:
            keys = tracked | self._pending_removals
            self._pending_removals.clear()
        if keys and not self._master_down():
            remove_keys(store, sorted(keys))
        if self._pool is not None:
            self._pool.close()
        store.close()
        if ctx is not None:
            ctx.term()


__all__ = ["MooncakeStoreConnector", "error_name", "parse_size"]
