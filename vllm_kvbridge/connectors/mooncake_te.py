"""Cross-host transport over Mooncake's transfer engine: one-sided reads of registered memory.

Every connector owns one ``mooncake.engine.TransferEngine`` (``P2PHANDSHAKE``: no metadata
service, peers are named ``host:rpc_port``) and one pool of registered host buffers
(:class:`~vllm_kvbridge.connectors.registered_pool.RegisteredBufferPool`, shared with the
Mooncake store connector).

**Pull, not push.** The sender packs the payload straight into a registered slab (the one
copy: :meth:`~vllm_kvbridge.wire.Encoded.pack_into`) and keeps it; the receiver reads it
with the engine into a registered slab of its own and decodes it in place. Push (the sender
writing into a buffer the receiver announced) would make ``put`` wait for a receiver to
exist and announce a size it cannot know; pull keeps ``put`` local and non-blocking (a
sender may run ahead of a receiver that has not started), lets the receiver size its buffer
exactly and check ``max_payload_bytes`` before any byte moves, and is what vLLM's NIXL
path does (the decode side READs). On RDMA the read is one-sided: the sender's CPU is not
involved in moving the bytes.

**Control** (:mod:`~vllm_kvbridge.connectors.te_control`, a ZeroMQ ROUTER the sender owns,
its address ``endpoint`` in the put metadata beside the engine's ``segment``; the sender's
side is the one held table, :mod:`~vllm_kvbridge.connectors.held_table`, the receiver's the
one claim loop, :meth:`~vllm_kvbridge.connectors.te_control.ControlClient.claim`): the receiver
CLAIMs a key and gets ``(address, nbytes, lease)``; it reads; it sends DONE, and the sender
returns the slab to its pool. A claimed key is invisible to other receivers (destructive
read). The sender releases a slab when the receiver confirms, when an unclaimed key's
``ttl_s`` passes, or when a claim's ``lease_s`` passes (a long read renews its claim between
batches once a third of ``lease_s`` has gone); a slab whose lease expired is
unregistered and never reused (a late reader's read fails instead of reading another
payload), and the late reader's DONE is answered EXPIRED, which fails its get. A receiver
still waiting for an unclaimed key RENEWs it (:meth:`~MooncakeTransferEngineConnector.renew`):
its expiry moves to ``lease_s`` from then, so it can outlive ``ttl_s``; ``health()["expired"]``
counts unclaimed payloads dropped when their ``ttl_s`` or renewal lease passed.

**Large transfers** are split into ``piece_bytes`` pieces read in batches of at most
``max_batch_pieces``; at most ``max_queued_pieces`` pieces are queued at once per connector
(all threads together). The engine's TCP transport refuses a batch beyond its per-peer
queue (seen here: 4,096 pieces fail with "TCP lane queue-full", and the next transfer to
that peer fails too, unless ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` is raised).

**Failures**: a sender that is gone is a :class:`TransferError` as soon as its control port
refuses connections (well within any deadline); a read the engine fails (peer died
mid-transfer, address not registered) is a :class:`TransferError` naming the segment; a
peer that never answers is a :class:`TransferTimeout` at the deadline. A deadline bounds
the wait for the key, never a read in progress.

Config keys: ``local_hostname`` (``127.0.0.1``; the address peers reach this host at),
``host`` (control bind address, default ``local_hostname``), ``control_port`` (0: any),
``protocol`` (``tcp`` | ``rdma``), ``device_name`` (RDMA devices, e.g. ``mlx5_0``),
``ttl_s`` (300), ``lease_s`` (60: a claim's lease, and what one renewal grants an
unclaimed key; every put's metadata says it), ``piece_bytes`` (4 MiB), ``max_batch_pieces`` (256),
``max_queued_pieces`` (1024), ``max_payload_bytes`` (64 GiB), ``max_held_bytes`` (8 GiB of
unconsumed payloads per sender), ``buffer_pool_bytes`` (1 GiB of slabs kept registered),
``request_timeout_s`` (5: how long a get without deadline, or a renew, waits for an answer),
``limits`` (:class:`~vllm_kvbridge.wire.Limits`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
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
    offset_port,
)
from vllm_kvbridge.connectors.held_table import Held, HeldTable
from vllm_kvbridge.connectors.registered_pool import RegisteredBufferPool
from vllm_kvbridge.errors import (
    PayloadError,
    TransferCorrupt,
    TransferError,
    TransferTimeout,
)

#: Default read split (``piece_bytes``, ``max_batch_pieces``): 4 MiB pieces keep several TCP
#: lanes busy; 256 pieces per batch stay far below the engine's per-peer queue (~4,096).
PIECE_BYTES = 4 << 20
MAX_BATCH_PIECES = 256


def _has_rdma_devices(engine: Any, device_name: str) -> bool:
    """Whether the engine's topology (``{"cpu:0": [[preferred NICs], [others]], ...}``) lists a NIC."""
    try:
        topology = json.loads(engine.get_local_topology(device_name or None))
    except (ValueError, TypeError):
        return False
    return any(nic for tiers in topology.values() for tier in tiers for nic in tier)


class MooncakeTransferEngineConnector(Connector):
    """One-sided reads over Mooncake's transfer engine; see the module docstring."""

    name = "MooncakeTransferEngineConnector"
    data_outlives_sender = False  # it is read from the sender's registered memory

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        # Everything _close() touches exists before anything can fail.
        self._engine: Any = None
        self._pool: RegisteredBufferPool | None = None
        self._server: ctl.ControlServer | None = None
        self._client: ctl.ControlClient | None = None
        self._ctx: zmq.Context | None = None
        self._lock = threading.Lock()
        # Registered slabs held until their reader is done (claim ids: the u64 lease of the
        # protocol); a reader claiming again renews its lease. Limits set below.
        self._table: HeldTable[np.ndarray] = HeldTable(
            0.0, 0.0, 0, reclaim_renews=True, on_expired=self._expired
        )
        self._reads = 0  # reads in progress (close waits for them)
        self._reads_done = threading.Condition(self._lock)
        self._queued = 0  # pieces queued in the engine by this connector
        self._queue_room = threading.Condition(threading.Lock())
        self._counters = {"read_batches": 0, "lease_renewals": 0}
        self.endpoint: str | None = None

        cfg = self.config
        self.local_hostname = str(cfg.get("local_hostname", "127.0.0.1"))
        self.host = str(cfg.get("host", self.local_hostname))
        self.control_port = number_option(cfg, "control_port", 0, int)
        self.protocol = choice_option(cfg, "protocol", ("tcp", "rdma"))
        self.device_name = str(cfg.get("device_name", "") or "")
        self.ttl_s = number_option(cfg, "ttl_s", 300.0)
        self.lease_s = number_option(cfg, "lease_s", DEFAULT_LEASE_S)
        self.piece_bytes = max(1, number_option(cfg, "piece_bytes", PIECE_BYTES, int))
        self.max_batch_pieces = max(1, number_option(cfg, "max_batch_pieces", MAX_BATCH_PIECES, int))
        self.max_queued_pieces = max(
            self.max_batch_pieces, number_option(cfg, "max_queued_pieces", 1024, int)
        )
        self.max_payload_bytes = number_option(cfg, "max_payload_bytes", 64 << 30, int)
        self.max_held_bytes = number_option(cfg, "max_held_bytes", 8 << 30, int)
        self.buffer_pool_bytes = number_option(cfg, "buffer_pool_bytes", 1 << 30, int)
        self.request_timeout_s = number_option(cfg, "request_timeout_s", 5.0)
        self._table.set_limits(self.ttl_s, self.lease_s, self.max_held_bytes)
        self._limits = cfg.get("limits")
        self._receiver_id = os.urandom(8)

        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ImportError(
                f"{self.name} needs Mooncake's transfer engine: pip install 'vllm-kvbridge[mooncake]' ({exc})"
            ) from exc
        engine = TransferEngine()
        rc = engine.initialize(self.local_hostname, "P2PHANDSHAKE", self.protocol, self.device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake transfer engine initialize failed (rc={rc}; local_hostname "
                f"{self.local_hostname}, protocol {self.protocol}, device_name {self.device_name!r})"
            )
        if self.protocol == "rdma" and not _has_rdma_devices(engine, self.device_name):
            # initialize() succeeds without a NIC; every transfer would fail later instead.
            raise TransferError(
                f"protocol 'rdma' but the transfer engine found no RDMA device "
                f"(device_name {self.device_name!r}); use protocol 'tcp' or name an RDMA NIC"
            )
        self._engine = engine
        self.segment = f"{self.local_hostname}:{engine.get_rpc_port()}"
        self._pool = RegisteredBufferPool(
            engine.register_memory, engine.unregister_memory, self.buffer_pool_bytes, "transfer engine"
        )
        self._ctx = zmq.Context()
        self._client = ctl.ControlClient(self._ctx, lambda: self._closed)

    # -- sender -------------------------------------------------------------------------
    @classmethod
    def config_for_rank(cls, config: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """A fixed ``control_port`` P: TP rank r binds P + r (all ranks of a stage share one config)."""
        return offset_port(config, "control_port", rank)

    def receiver_metadata(self) -> dict[str, Any]:
        """The control endpoint (bound now if it was not yet) and this engine's segment:
        what every put's metadata holds besides the size, the same for every key."""
        return {"endpoint": self._ensure_server(), "segment": self.segment, "lease_s": self.lease_s}

    def put(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        """Pack ``payload`` into a registered slab and hold it under ``key`` for a receiver.

        The payload is copied (once): the caller may reuse its tensors when this returns.
        Refusals (too big, over ``max_held_bytes``, key already held) return ``ok=False``;
        over ``max_held_bytes`` it is ``full`` (room comes back as receivers read).
        """
        self._check_open()
        self._check_key(key)
        return self._put_reserved(from_stage, to_stage, key, payload)

    def reserve(self, from_stage: Stage, to_stage: Stage, key: str, nbytes: int) -> Any:
        """A registered slab to write a packed payload of ``nbytes`` into; publishing holds
        it for receivers to read one-sided (no further copy). Counts against
        ``max_held_bytes`` from now. See :class:`~vllm_kvbridge.connectors.base.Reservation`."""
        return self._reserve_slab(self._table, self._pool, key, nbytes, self._ensure_server)

    def _publish_lent(self, r: LentReservation, start: float) -> PutResult:
        """Hold the written slab of ``r`` under its key for receivers (see :meth:`reserve`)."""
        if (failed := self._publish_slab(self._table, r)) is not None:
            return failed
        endpoint = r.lent[1]
        with self._lock:
            server = self._server
        if server is not None:
            server.key_put(r.key)  # receivers waiting for it get it now
        self.stats.add(puts=1, put_bytes=r.nbytes, put_seconds=time.perf_counter() - start)
        return PutResult(
            ok=True,
            nbytes=r.nbytes,
            metadata={
                "endpoint": endpoint,
                "segment": self.segment,
                "nbytes": r.nbytes,
                "lease_s": self.lease_s,
            },
        )

    def _release_lent(self, r: LentReservation) -> None:
        """An unpublished reservation ends: its slab and its held bytes go back."""
        self._release_slab(self._table, self._pool, r)

    def _ensure_server(self) -> str:
        with self._lock:
            self._check_open()
            if self._server is None:
                server = ctl.ControlServer(
                    self._ctx, self.host, self.control_port, self.local_hostname, self._answer
                )
                server.start(self.sweep, max(0.01, min(self.ttl_s / 4, self.lease_s / 4, 1.0)))
                self._server, self.endpoint = server, server.endpoint
            return self.endpoint

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The control server's handler (runs on its thread)."""
        op = request[0]
        if op == ctl.CLAIM and len(request) == 4 and len(request[2]) == 8 and len(request[3]) == 8:
            key, claimer, limit = (
                request[1].decode("ascii", "replace"),
                request[2],
                ctl.U64.unpack(request[3])[0],
            )
            # Claiming again renews the lease: a long read keeps its slab alive.
            held = self._table.claim(key, claimer, limit)
            if held is None:
                return [ctl.MISSING]
            if held.nbytes > limit:
                return [ctl.TOOBIG, ctl.U64.pack(held.nbytes)]
            fields = (held.value.ctypes.data, held.nbytes, held.claim, int(self.lease_s * 1000))
            return [ctl.OK, *(ctl.U64.pack(v) for v in fields)]
        if op == ctl.DONE and len(request) == 3 and len(request[2]) == 8:
            key, lease = request[1].decode("ascii", "replace"), ctl.U64.unpack(request[2])[0]
            if (held := self._table.release_claim(lease, key)) is None:
                return [ctl.EXPIRED]
            self._pool.release(held.value)
            return [ctl.DONE]
        if op == ctl.RENEW and len(request) == 2:  # a claim's own lease governs a claimed key
            return [ctl.OK if self._table.renew(request[1].decode("ascii", "replace")) else ctl.MISSING]
        return [ctl.BAD]

    def sweep(self) -> None:
        """Drop unclaimed payloads past ``ttl_s`` (or their renewal's lease) and claims past ``lease_s``."""
        self._table.sweep()

    def _expired(self, held: Held[np.ndarray]) -> None:
        """What :meth:`sweep` took goes back to the pool; a claimed slab is discarded: a
        reader may still hold its address, so it is never handed out again."""
        (self._pool.discard if held.claimed else self._pool.release)(held.value)

    # -- receiver -----------------------------------------------------------------------
    def get(
        self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None, *, deadline: Due = None
    ) -> Any | None:
        """Claim ``key`` at the sender in ``metadata``, read it, confirm, decode in place.

        Without a deadline, one claim: ``None`` if the key is not there. With one, retries
        (1 ms backoff up to 20 ms) until the deadline, then :class:`TransferTimeout`.
        :class:`TransferError` when the sender is gone or the read fails,
        :class:`TransferRefused` over ``max_payload_bytes``, :class:`TransferCorrupt` when the
        data does not decode. The returned tensors view a registered slab of this
        connector, which goes back to its pool when the last of them is freed.
        """
        self._check_open()
        self._check_key(key)
        endpoint, segment = (metadata or {}).get("endpoint"), (metadata or {}).get("segment")
        if not isinstance(endpoint, str) or not isinstance(segment, str):
            raise TransferError(
                f"cannot get {key!r}: the put metadata lacks the sender's 'endpoint' and 'segment' "
                f"(metadata={dict(metadata or {})!r})"
            )
        start = time.perf_counter()
        try:
            claim = self._claim(endpoint, key, deadline)
            if claim is None:
                self.stats.add(get_misses=1)
                return None
            payload, nbytes = self._read(endpoint, segment, key, *claim)
        except TransferError as exc:
            self.stats.add(**({"timeouts": 1} if isinstance(exc, TransferTimeout) else {"get_failures": 1}))
            raise
        self.stats.add(gets=1, get_bytes=nbytes, get_seconds=time.perf_counter() - start)
        return payload

    def renew(self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None) -> bool:
        """RENEW ``key`` at the sender in ``metadata`` (see the module docstring): True while it
        holds the key, False once not; :class:`TransferError` past ``request_timeout_s``."""
        self._check_open()
        self._check_key(key)
        endpoint = (metadata or {}).get("endpoint")
        if not isinstance(endpoint, str):
            raise TransferError(f"cannot renew {key!r}: the put metadata lacks the sender's 'endpoint'")
        return self._client.renew(endpoint, key, self.request_timeout_s)

    def _claim(self, endpoint: str, key: str, deadline: float | None) -> tuple[int, int, int, int] | None:
        """``(address, nbytes, lease, lease_ms)`` of the claimed key, ``None`` if missing (no deadline)."""
        answer = self._client.claim(
            endpoint,
            key,
            self._claim_request(key),
            deadline,  # the sender holds each request until the key is put
            fields=4,
            request_timeout_s=self.request_timeout_s,
            max_payload_bytes=self.max_payload_bytes,
            check_open=self._check_open,
        )
        if answer is None:
            return None
        addr, nbytes, lease, lease_ms = (ctl.U64.unpack(a)[0] for a in answer)
        return addr, nbytes, lease, lease_ms

    def _claim_request(self, key: str) -> list[bytes]:
        return [ctl.CLAIM, key.encode("ascii"), self._receiver_id, ctl.U64.pack(self.max_payload_bytes)]

    def _read(
        self, endpoint: str, segment: str, key: str, addr: int, nbytes: int, lease: int, lease_ms: int
    ) -> tuple[Any, int]:
        from vllm_kvbridge.wire import decode_packed

        with self._lock:
            self._check_open()
            self._reads += 1
        try:
            slab, _ = self._pool.acquire(nbytes)
            try:
                # Renew well before the sender's lease (it says how long) runs out.
                renew_every = max(0.001, lease_ms / 3000)
                self._transfer(
                    segment,
                    slab.ctypes.data,
                    addr,
                    nbytes,
                    key,
                    lambda: self._renew(endpoint, key),
                    renew_every,
                )
                # The sender may reuse its slab only after this; an expired lease means the
                # bytes we read may not be the payload any more.
                answer = self._client.request(
                    endpoint, [ctl.DONE, key.encode("ascii"), ctl.U64.pack(lease)], time.monotonic() + 30
                )
                if answer != [ctl.DONE]:
                    raise TransferError(
                        f"{key!r}: the sender's lease ran out during the read ({answer!r}); "
                        f"the sender's lease_s is {lease_ms / 1000} s"
                    )
            except BaseException:
                self._pool.release(slab)
                raise
            view = self._pool.lend_view(slab, nbytes)  # releases the slab when the tensors go
        finally:
            with self._lock:
                self._reads -= 1
                self._reads_done.notify_all()
        try:
            return decode_packed(view, limits=self._limits, copy=False), nbytes
        except PayloadError as exc:
            raise TransferCorrupt(f"{key!r} from {segment} does not decode: {exc}") from exc

    def _renew(self, endpoint: str, key: str) -> None:
        """Claim again (same receiver: same lease, new expiry); fails if the claim is gone."""
        with self._lock:
            self._counters["lease_renewals"] += 1
        request = self._claim_request(key)
        answer = self._client.request(endpoint, request, time.monotonic() + self.request_timeout_s)
        if not answer or answer[0] != ctl.OK:
            raise TransferError(f"{key!r}: the claim at {endpoint} was lost during the read ({answer!r})")

    def _transfer(
        self,
        segment: str,
        dst: int,
        src: int,
        nbytes: int,
        key: str,
        renew: Callable[[], None],
        renew_every: float,
    ) -> None:
        """Read ``nbytes`` from ``segment:src`` into ``dst``, in batches the engine accepts,
        calling ``renew`` between batches once ``renew_every`` seconds have passed."""
        piece = self.piece_bytes
        offsets = list(range(0, nbytes, piece))
        renewed = time.monotonic()
        for first in range(0, len(offsets), self.max_batch_pieces):
            if time.monotonic() - renewed > renew_every:
                renew()
                renewed = time.monotonic()
            batch = offsets[first : first + self.max_batch_pieces]
            lengths = [min(piece, nbytes - off) for off in batch]
            self._reserve(len(batch))
            try:
                if len(batch) == 1:
                    rc = self._engine.transfer_sync_read(segment, dst + batch[0], src + batch[0], lengths[0])
                else:
                    rc = self._engine.batch_transfer_sync_read(
                        segment, [dst + o for o in batch], [src + o for o in batch], lengths
                    )
            finally:
                self._unreserve(len(batch))
            with self._lock:
                self._counters["read_batches"] += 1
            if rc != 0:
                raise TransferError(
                    f"transfer-engine read of {key!r} ({nbytes} bytes, "
                    f"pieces {first}..{first + len(batch) - 1}) "
                    f"from {segment} failed (rc={rc}); the peer died, dropped the claim (lease), or a batch "
                    f"exceeded its queue "
                    f"(max_batch_pieces={self.max_batch_pieces})"
                )

    def _reserve(self, pieces: int) -> None:
        with self._queue_room:
            while self._queued + pieces > self.max_queued_pieces:
                self._queue_room.wait(0.1)
                self._check_open()
            self._queued += pieces

    def _unreserve(self, pieces: int) -> None:
        with self._queue_room:
            self._queued -= pieces
            self._queue_room.notify_all()

    # -- lifecycle ----------------------------------------------------------------------
    def cleanup(self, key: str) -> None:
        """Drop what this side holds for ``key`` (a claimed slab is not reused). Idempotent."""
        self._check_key(key)
        held = self._table.drop(key, claimed_too=True)
        if held is not None and self._pool is not None:
            (self._pool.discard if held.claimed else self._pool.release)(held.value)
            self.stats.add(cleanups=1)

    def health(self) -> dict[str, Any]:
        pool, held = self._pool, self._table.counts()
        with self._lock:
            extra = {
                "endpoint": self.endpoint,
                "segment": getattr(self, "segment", None),
                "protocol": self.protocol,
                "held_payloads": held["held"] + held["claimed"],
                "held_bytes": held["held_bytes"],
                "claimed": held["claimed"],
                "read_batches": self._counters["read_batches"],
                "expired": held["expired"],
                "lease_expired": held["lease_expired"],
                "lease_renewals": self._counters["lease_renewals"],
            }
        extra["registered_bytes"] = pool.registered_bytes if pool is not None else 0
        extra["lent_buffers"] = pool.lent if pool is not None else 0
        extra["pooled_buffer_bytes"] = pool.pooled_bytes if pool is not None else 0
        return {**super().health(), **extra}

    def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        with self._lock:
            # Reads in progress write into our slabs: let them finish before unregistering.
            self._reads_done.wait_for(lambda: self._reads == 0, timeout=10)
        held = self._table.clear()
        if self._client is not None:
            self._client.close()
        if self._pool is not None:
            self._pool.close()  # unregisters held, free and lent slabs alike
        del held
        # The engine has no close(): dropping the last reference stops its threads and
        # closes its RPC port (checked by the tests).
        self._engine = None
        if self._ctx is not None:
            self._ctx.term()


__all__ = ["MAX_BATCH_PIECES", "PIECE_BYTES", "MooncakeTransferEngineConnector"]
