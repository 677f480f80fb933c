"""Cross-host transport over TCP with ZeroMQ: the sender serves, the receiver pulls.

Sender: :meth:`ZmqConnector.put` encodes the payload (:func:`vllm_kvbridge.wire.encode`;
tensors are referenced, not copied) and keeps the frames in memory under ``key`` (in the
pull connectors' one held table, :mod:`~vllm_kvbridge.connectors.held_table`). A
background thread owns a ROUTER socket bound to ``host``/``port`` (port 0: ephemeral) and
answers requests (that half: :mod:`~vllm_kvbridge.connectors.zmq_server`); the address
is in ``PutResult.metadata["endpoint"]``. Frames are sent
with ``copy=False``. Unclaimed payloads are dropped after ``ttl_s``, or ``lease_s`` after a
receiver's last ``RENEW``; the bytes held at once are bounded by ``max_inflight_bytes``
(a put over it is refused with ``PutResult.full``: the sender waits for room).

Receiver: :meth:`ZmqConnector.get` sends ``GET`` over a DEALER socket connected to the
endpoint (sockets are pooled per endpoint; a socket is used by one thread at a time),
receives the reply with ``copy=False`` and decodes it in place
(:func:`vllm_kvbridge.wire.decode_frames`). A get without a deadline asks once: "not there
yet" is an immediate ``MISSING``. A get with a deadline *long-polls* (the pull connectors' one
claim loop, :mod:`~vllm_kvbridge.connectors.claim_loop`): its GET asks the server
to hold it up to the time left (at most ``LONG_POLL_S`` per request), and the server answers
it the moment a put of that key lands, so the payload is seen on arrival rather than at the
next retry (the old 1-20 ms backoff made a 1 KB handoff take ~8 ms p50 where the transport
takes ~0.2 ms). A server holding ``MAX_WAITERS`` requests answers ``MISSING`` at once and
that receiver falls back to retrying with backoff.

Delivery: a get's deadline bounds *availability*, never a transfer in progress. The server
answers a GET for a held key with a small ``OK`` header first and the data in a second
message; a receiver that saw the header before its deadline keeps receiving until the data
is in (bounded by ``request_timeout_s`` plus the size over ``min_transfer_bytes_per_s``), so
a large KV polled in short slices by the KV manager is not lost. The server keeps the entry
until the receiver confirms it (``ACK`` once the data is complete, answered ``ACKED`` before
``get`` returns) or its TTL passes: a receiver that times out or dies mid-transfer can get
it again. A receiver socket that timed out with a request outstanding is closed, never
pooled, so no stale reply can be mistaken for the answer to a later request.

Wire protocol (multipart messages; ``nonce`` pairs a reply with its request)::

    request  [b"GET", nonce(8), key, max_bytes(u64 le)(, hold_ms(u64 le))]
    replies  [nonce, b"OK", sizes(u64 le * n)] then [nonce, b"DATA", frame_1 .. frame_n]
             [nonce, b"MISSING"] | [nonce, b"TOOBIG", size(u64 le)] | [nonce, b"BAD"]
    confirm  [b"ACK", nonce(8), key]  ->  [nonce, b"ACKED"]
    renew    [b"RENEW", nonce(8), key]  ->  [nonce, b"OK"] | [nonce, b"MISSING"]

Size checks happen before allocation on both sides: the request carries the receiver's
``max_payload_bytes`` and the server answers ``TOOBIG`` instead of sending; the receiver
also sets ``ZMQ_MAXMSGSIZE`` so libzmq drops any larger frame before allocating it, and
checks the advertised sizes against the frames before decoding.

CURVE (optional; :mod:`~vllm_kvbridge.connectors.zmq_curve`): give the connector its
keypair (``curve_public_key``, ``curve_secret_key``, z85 strings from
:func:`zmq.curve_keypair`). As a server it only
admits clients listed in ``curve_allowed_clients`` (z85 public keys; ZAP handler in the
connector's own context); as a client it authenticates with its keypair and pins the
server key from ``curve_server_key`` or, failing that, ``metadata["server_key"]``. A peer
without an admitted key gets nothing: its gets time out. ``curve_keys_env: NAME`` instead
takes one keypair from the environment variable ``NAME`` (JSON ``{"public", "secret"}``)
and uses it on both ends: the server admits exactly that key and a client pins it. The
pipeline does that for every ZMQ edge bound beyond loopback (a keypair per edge and run,
handed to the edge's two stages in their environment, never in a config or a log).

Other config keys: ``host`` (default 127.0.0.1), ``port`` (0), ``advertise_host`` (address
put in the metadata; default ``host``, or this host's name when binding 0.0.0.0/``*``),
``endpoint`` (default peer endpoint when a get has no metadata), ``request_timeout_s``
(5: how long a get without deadline waits for an answer, and the base of the data wait),
``min_transfer_bytes_per_s`` (10 MB/s: below this the data wait gives up),
``max_payload_bytes`` (64 GiB), ``max_inflight_bytes`` (8 GiB), ``pool_keep_bytes`` (2 GiB:
reserved send buffers kept for reuse), ``ttl_s`` (300: how long an
unconfirmed payload is held), ``lease_s`` (``DEFAULT_LEASE_S``: how long one renewal holds it).
"""

from __future__ import annotations

import socket as pysocket
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq

from vllm_kvbridge.connectors import zmq_server
from vllm_kvbridge.connectors.base import (
    DEFAULT_LEASE_S,
    Connector,
    Due,
    HeapReservation,
    Meta,
    PutResult,
    Stage,
    number_option,
    offset_port,
)
from vllm_kvbridge.connectors.claim_loop import MISSING as NOT_YET
from vllm_kvbridge.connectors.claim_loop import Retry, claim_until_deadline
from vllm_kvbridge.connectors.registered_pool import RegisteredBufferPool
from vllm_kvbridge.connectors.zmq_curve import CurveKeys
from vllm_kvbridge.connectors.zmq_server import (
    ACK,
    DATA,
    GET,
    MISSING,
    OK,
    RENEW,
    TOOBIG,
    U64,
    PayloadStore,
    ZmqServer,
)
from vllm_kvbridge.errors import (
    ConfigError,
    ConnectorClosed,
    PayloadError,
    TransferCorrupt,
    TransferError,
    TransferRefused,
    TransferTimeout,
)

_MAX_IDLE_SOCKETS = 8


def _no_registration(ptr: int, nbytes: int) -> int:
    return 0  # plain host memory: the pool only keeps it for reuse


def _no_unregistration(ptr: int) -> int:
    return 0


class ZmqConnector(Connector):
    """Point-to-point TCP transport: the sender serves payloads from memory, receivers pull."""

    name = "ZmqConnector"
    data_outlives_sender = False  # the sender's ROUTER socket serves it from the sender's memory

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.host = str(cfg.get("host", "127.0.0.1"))
        self.port = number_option(cfg, "port", 0, int)
        advertise = cfg.get("advertise_host")
        if advertise is None:
            advertise = pysocket.gethostname() if self.host in ("0.0.0.0", "*") else self.host
        self.advertise_host = str(advertise)
        self.default_endpoint = cfg.get("endpoint")
        self.ttl_s = number_option(cfg, "ttl_s", 300.0)
        self.lease_s = number_option(cfg, "lease_s", DEFAULT_LEASE_S)
        self.request_timeout_s = number_option(cfg, "request_timeout_s", 5.0)
        self.min_transfer_bytes_per_s = number_option(cfg, "min_transfer_bytes_per_s", 10e6)
        if self.min_transfer_bytes_per_s <= 0:
            raise ConfigError("connector option 'min_transfer_bytes_per_s' must be positive")
        self.max_payload_bytes = number_option(cfg, "max_payload_bytes", 64 << 30, int)
        self.max_inflight_bytes = number_option(cfg, "max_inflight_bytes", 8 << 30, int)
        self._limits = cfg.get("limits")
        self._curve = CurveKeys.from_config(self.config)

        self._ctx = zmq.Context()
        self._lock = threading.Lock()  # the server's start, the socket pool, nonces
        self._store = PayloadStore(self.ttl_s, self.lease_s, self.max_inflight_bytes)
        self.pool_keep_bytes = number_option(cfg, "pool_keep_bytes", 2 << 30, int)
        self._buffers = RegisteredBufferPool(
            _no_registration, _no_unregistration, self.pool_keep_bytes, "ZMQ"
        )
        self._server = ZmqServer(self._ctx, self._store, sweep_every=max(0.01, min(self.ttl_s / 4, 1.0)))
        self._idle: dict[tuple[str, bytes | None], list[zmq.Socket]] = {}
        self._busy: set[zmq.Socket] = set()
        self._nonce = 0
        self._auth: Any = None
        self.endpoint: str | None = None

    def receiver_metadata(self) -> dict[str, Any]:
        """The server's endpoint (it binds now if it has not yet) and its CURVE key."""
        metadata = {"endpoint": self._ensure_server()}
        if self._curve.public is not None:
            metadata["server_key"] = self._curve.public.decode("ascii")
        return metadata

    @classmethod
    def config_for_rank(cls, config: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """A fixed ``port`` P: TP rank r binds P + r (all ranks of a stage share one config)."""
        return offset_port(config, "port", rank)

    # -- sender -------------------------------------------------------------------------
    def put(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        """Keep ``payload`` in memory under ``key`` and serve it until claimed or expired.

        The payload's tensors are referenced, not copied: do not modify them until the
        receiver has them (or :meth:`cleanup`). Refusals (too big, over
        ``max_inflight_bytes``, key already held) return ``ok=False`` with ``error``; over
        ``max_inflight_bytes`` it is ``full`` (room comes back as receivers read).
        """
        from vllm_kvbridge.wire import encode

        self._check_open()
        self._check_key(key)
        return self._hold(key, list(encode(payload).frames()), time.perf_counter())

    def reserve(self, from_stage: Stage, to_stage: Stage, key: str, nbytes: int) -> Any:
        """A host buffer of this process to write a packed payload into; publishing serves
        its frames as views of it (no further copy before the socket). Buffers are pooled
        (``pool_keep_bytes``): one returns when the receiver confirmed its payload (or it
        expired) and libzmq has sent it, so a sender's next KV reuses pages already faulted
        in rather than a fresh allocation (~1.3 GB/s of page faults). See
        :class:`~vllm_kvbridge.connectors.base.Reservation`."""
        self._check_open()
        self._check_key(key)
        if (refused := self._refuse_oversize(nbytes)) is not None:
            return refused
        slab, _ = self._buffers.acquire(nbytes)
        storage = self._buffers.lend_view(slab, nbytes)  # back to the pool once sent and confirmed
        return HeapReservation(
            self, from_stage, to_stage, key, nbytes, publish=self._publish_packed, storage=storage
        )

    def _publish_packed(self, r: HeapReservation, start: float) -> PutResult:
        from vllm_kvbridge.wire.decode import packed_frames

        return self._hold(r.key, packed_frames(r.buffer[: r.nbytes], limits=self._limits), start)

    def _hold(self, key: str, frames: list[Any], start: float) -> PutResult:
        """Keep ``frames`` under ``key`` and serve them until claimed or expired."""
        sizes = [memoryview(f).nbytes for f in frames]
        total = sum(sizes)
        if (refused := self._refuse_oversize(total)) is not None:
            return refused
        endpoint = self._ensure_server()
        self._check_open()
        refused, awaited = self._store.add(key, frames, sizes)
        if refused is not None:
            return self._put_refused(refused)
        if awaited:
            self._server.key_put()  # the server answers the GETs it holds for this key
        self.stats.add(puts=1, put_bytes=total, put_seconds=time.perf_counter() - start)
        metadata: dict[str, Any] = {"endpoint": endpoint, "lease_s": self.lease_s}
        if self._curve.public is not None:
            metadata["server_key"] = self._curve.public.decode("ascii")
        return PutResult(ok=True, nbytes=total, metadata=metadata)

    def _ensure_server(self) -> str:
        with self._lock:
            if self.endpoint is not None:
                return self.endpoint
            self._check_open()
            router = self._ctx.socket(zmq.ROUTER)
            router.linger = 0
            if self._curve.enabled:
                self._auth = self._curve.secure_server(self._ctx, router)
            try:
                if self.port:
                    router.bind(f"tcp://{self.host}:{self.port}")
                    port = self.port
                else:
                    port = router.bind_to_random_port(f"tcp://{self.host}")
            except zmq.ZMQError as exc:
                router.close()
                raise TransferRefused(f"cannot bind tcp://{self.host}:{self.port}: {exc}") from exc
            self.endpoint = f"tcp://{self.advertise_host}:{port}"
            self._server.start(router)
            return self.endpoint

    # -- receiver -----------------------------------------------------------------------
    def get(
        self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None, *, deadline: Due = None
    ) -> Any | None:
        """Pull ``key`` from the endpoint in ``metadata`` (or config ``endpoint``).

        With a deadline, long-polls: the sender's server holds the request until the key is
        put (answering at once) or ``LONG_POLL_S`` passes, and the get asks again until the
        deadline passes, then raises :class:`TransferTimeout` (also when the peer never
        answers; a server holding too many requests answers at once and the get retries with
        1-20 ms backoff). Without a
        deadline, one request: ``None`` if missing, :class:`TransferTimeout` if no answer
        within ``request_timeout_s``. :class:`TransferRefused` when the payload exceeds
        ``max_payload_bytes``; :class:`TransferCorrupt` when it does not decode.
        """
        endpoint, server_key = self._peer(key, metadata)
        start = time.perf_counter()
        try:
            frames = self._pull(endpoint, server_key, key, deadline)
        except TransferTimeout:
            self.stats.add(timeouts=1)
            raise
        except TransferError:
            self.stats.add(get_failures=1)
            raise
        if frames is None:
            self.stats.add(get_misses=1)
            return None
        payload, nbytes = self._decode(key, frames)
        self.stats.add(gets=1, get_bytes=nbytes, get_seconds=time.perf_counter() - start)
        return payload

    def _peer(self, key: str, metadata: Mapping[str, Any] | None) -> tuple[str, bytes | None]:
        """The sender's endpoint and CURVE server key for ``key`` (TransferError if unknown)."""
        self._check_open()
        self._check_key(key)
        endpoint = (metadata or {}).get("endpoint") or self.default_endpoint
        if not endpoint:
            raise TransferError(
                f"cannot reach the sender of {key!r}: no endpoint in the put metadata "
                f"(metadata={metadata!r}) and no 'endpoint' in the {self.name} config"
            )
        server_key = self._curve.server_key_for(metadata)
        if server_key is None and self._curve.enabled:
            raise TransferError(
                f"cannot reach the sender of {key!r}: CURVE is configured but neither "
                "curve_server_key nor metadata['server_key'] gives the server's public key"
            )
        return str(endpoint), server_key

    def renew(self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None) -> bool:
        """Ask the sender to hold ``key`` for its ``lease_s``; TransferError without an answer
        within ``request_timeout_s``."""
        endpoint, server_key = self._peer(key, metadata)
        sock = self._checkout(endpoint, server_key)
        answer = None
        try:
            nonce = self._next_nonce()
            wait_until = time.monotonic() + self.request_timeout_s
            if self._poll(sock, zmq.POLLOUT, wait_until):
                sock.send_multipart([RENEW, nonce, key.encode("ascii")], zmq.NOBLOCK)
                answer = self._recv_reply(sock, nonce, wait_until)
        except zmq.ContextTerminated:
            raise ConnectorClosed(f"{self.name} closed during renew") from None
        finally:
            self._checkin(endpoint, server_key, sock, answer is not None)
        if answer is None:
            raise TransferError(f"no answer from {endpoint} to the renewal of {key!r}")
        return answer[1].bytes == OK

    def _pull(
        self, endpoint: str, server_key: bytes | None, key: str, deadline: float | None
    ) -> list[zmq.Frame] | None:
        sock = self._checkout(endpoint, server_key)
        healthy = False  # until a request/answer completed cleanly

        def attempt(hold: float, wait_until: float) -> list[zmq.Frame] | Retry:
            nonlocal healthy
            healthy = False
            status, frames = self._request(sock, key, wait_until, hold)
            if status is None:
                raise TransferTimeout(f"no answer from {endpoint} for {key!r} before the deadline")
            healthy = status in (OK, TOOBIG, MISSING)
            if status == TOOBIG:
                size = U64.unpack(frames[0].bytes)[0] if frames and len(frames[0]) == 8 else -1
                raise TransferRefused(
                    f"{key!r} at {endpoint} is {size} bytes, over max_payload_bytes={self.max_payload_bytes}"
                )
            if status not in (OK, MISSING):
                raise TransferError(f"{endpoint} answered {status!r} for {key!r}")
            return frames if status == OK else NOT_YET

        try:
            return claim_until_deadline(
                attempt,
                deadline,
                not_there=f"{key!r} was not available at {endpoint} before the deadline",
                check_open=self._check_open,
                request_timeout_s=self.request_timeout_s,
                long_poll_s=zmq_server.LONG_POLL_S,  # the server holds each GET until the put
            )
        except zmq.ContextTerminated:
            healthy = False
            raise ConnectorClosed(f"{self.name} closed during get") from None
        finally:
            self._checkin(endpoint, server_key, sock, healthy)

    def _next_nonce(self) -> bytes:
        with self._lock:
            self._nonce += 1
            return U64.pack(self._nonce)

    def _request(
        self, sock: zmq.Socket, key: str, wait_until: float, hold: float = 0.0
    ) -> tuple[bytes | None, list[zmq.Frame]]:
        """One GET, which the server may hold up to ``hold`` seconds for the key to be put;
        ``(None, [])`` when no (complete) answer came in time.

        ``wait_until`` bounds the wait for the answer header. Once an ``OK`` header is in,
        the data is waited for up to the transfer budget of its size, past ``wait_until``.
        """
        nonce = self._next_nonce()
        request = [GET, nonce, key.encode("ascii"), U64.pack(self.max_payload_bytes)]
        if hold > 0:
            request.append(U64.pack(int(hold * 1000)))
        if not self._poll(sock, zmq.POLLOUT, wait_until):
            return None, []
        sock.send_multipart(request, zmq.NOBLOCK)
        reply = self._recv_reply(sock, nonce, wait_until)
        if reply is None:
            return None, []
        if reply[1].bytes != OK:
            return reply[1].bytes, reply[2:]
        if len(reply) != 3 or len(reply[2]) % 8:
            raise TransferCorrupt(f"malformed OK header for {key!r}")
        sizes = reply[2]
        nbytes = sum(n for (n,) in U64.iter_unpack(sizes.bytes))
        budget = self.request_timeout_s + nbytes / self.min_transfer_bytes_per_s
        data = self._recv_reply(sock, nonce, max(wait_until, time.monotonic() + budget))
        if data is None:
            return None, []
        if data[1].bytes != DATA:
            raise TransferCorrupt(f"expected the data of {key!r}, got {data[1].bytes[:16]!r}")
        self._confirm_remote(sock, nonce, key)
        return OK, [sizes, *data[2:]]

    def _confirm_remote(self, sock: zmq.Socket, nonce: bytes, key: str) -> None:
        """Tell the sender it may drop ``key``; wait briefly for the ack so the release is
        visible when get() returns. A lost ack only leaves the entry to its TTL."""
        wait_until = time.monotonic() + self.request_timeout_s
        if not self._poll(sock, zmq.POLLOUT, wait_until):
            return
        sock.send_multipart([ACK, nonce, key.encode("ascii")], zmq.NOBLOCK)
        self._recv_reply(sock, nonce, wait_until)

    def _recv_reply(self, sock: zmq.Socket, nonce: bytes, wait_until: float) -> list[zmq.Frame] | None:
        while self._poll(sock, zmq.POLLIN, wait_until):
            reply = sock.recv_multipart(copy=False)
            # Only this socket's own outstanding request can be answered on it (sockets that
            # timed out are closed, not pooled); anything else is malformed and ignored.
            if len(reply) >= 2 and reply[0].bytes == nonce:
                return reply
        return None

    def _poll(self, sock: zmq.Socket, event: int, wait_until: float) -> bool:
        while True:
            left = wait_until - time.monotonic()
            # Wake at least every 100 ms so a close() elsewhere is noticed promptly.
            if sock.poll(max(0, min(int(left * 1000) + 1, 100)), event):
                return True
            if left <= 0:
                return False
            self._check_open()

    def _decode(self, key: str, frames: list[zmq.Frame]) -> tuple[Any, int]:
        from vllm_kvbridge.wire import decode_frames

        if not frames:
            raise TransferCorrupt(f"reply for {key!r} has no size frame")
        sizes_raw = frames[0].bytes
        body = frames[1:]
        if len(sizes_raw) != 8 * len(body):
            raise TransferCorrupt(
                f"reply for {key!r} advertises {len(sizes_raw) // 8} frames, carries {len(body)}"
            )
        sizes = [U64.unpack_from(sizes_raw, 8 * i)[0] for i in range(len(body))]
        total = sum(sizes)
        if total > self.max_payload_bytes:
            raise TransferRefused(f"reply for {key!r} is {total} bytes, over max_payload_bytes")
        buffers = [f.buffer for f in body]
        if [b.nbytes for b in buffers] != sizes:
            raise TransferCorrupt(f"reply for {key!r}: frame sizes do not match the advertised sizes")
        try:
            return decode_frames(buffers, limits=self._limits, copy=False), total
        except PayloadError as exc:
            raise TransferCorrupt(f"payload {key!r} does not decode: {exc}") from exc

    # -- client socket pool -------------------------------------------------------------
    def _checkout(self, endpoint: str, server_key: bytes | None) -> zmq.Socket:
        with self._lock:
            self._check_open()
            idle = self._idle.get((endpoint, server_key))
            if idle:
                sock = idle.pop()
                self._busy.add(sock)
                return sock
            sock = self._ctx.socket(zmq.DEALER)
            self._busy.add(sock)
        sock.linger = 0
        # libzmq drops any frame over this before allocating it (a hostile or broken peer).
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_payload_bytes)
        if server_key is not None:
            self._curve.secure_client(sock, server_key)
        sock.connect(endpoint)
        return sock

    def _checkin(self, endpoint: str, server_key: bytes | None, sock: zmq.Socket, healthy: bool) -> None:
        with self._lock:
            self._busy.discard(sock)
            idle = self._idle.setdefault((endpoint, server_key), [])
            if healthy and not self._closed and len(idle) < _MAX_IDLE_SOCKETS:
                idle.append(sock)
                return
        sock.close(linger=0)

    # -- lifecycle ----------------------------------------------------------------------
    def cleanup(self, key: str) -> None:
        """Drop ``key`` from the send store. Idempotent."""
        self._check_key(key)
        if self._store.drop(key):
            self.stats.add(cleanups=1)

    def health(self) -> dict[str, Any]:
        return {**super().health(), "endpoint": self.endpoint, **self._store.counts()}

    def _close(self) -> None:
        self._server.close()
        self._store.clear()
        with self._lock:
            idle = [s for socks in self._idle.values() for s in socks]
            self._idle.clear()
        for sock in idle:
            sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._buffers.close()  # buffers still viewed stay valid for their views
        # term() waits until sockets busy in other threads' gets are closed: their polls
        # raise ContextTerminated, they close their socket and raise ConnectorClosed.
        self._ctx.term()
