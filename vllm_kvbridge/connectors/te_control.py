"""The small control channel of the one-sided connectors (ZeroMQ, TCP).

Used by the Mooncake transfer-engine connector and the NIXL connector (the Mooncake store's
RENEW too). The bytes move
one-sided over the engine; this channel only says *where* a key's bytes are and *when* the
receiver is done with them. The sender's :class:`ControlServer`
owns a ROUTER socket on a background thread; receivers talk to it through
:class:`ControlClient` (DEALER sockets pooled per endpoint, one thread at a time each).

Messages (multipart; ``nonce`` pairs an answer with its request, so a late answer to a
timed-out request is never taken for the answer to the next one)::

    [b"CLAIM", nonce(8), key, receiver(8), max_bytes(u64)(, hold_ms(u64))]
        -> [nonce, b"OK", addr(u64), nbytes(u64), lease(u64), lease_ms(u64)]
         | [nonce, b"MISSING"] | [nonce, b"TOOBIG", nbytes(u64)]
    [b"DONE", nonce(8), key, lease(u64)]
        -> [nonce, b"DONE"] | [nonce, b"EXPIRED"]
    [b"RENEW", nonce(8), key]
        -> [nonce, b"OK"] | [nonce, b"MISSING"]
    anything else -> [nonce, b"BAD"]

A CLAIM by the receiver that already holds the claim answers the same lease again and
renews it for ``lease_ms``, so a claim whose answer arrived after the receiver's deadline
is simply re-issued by its next get (nothing is lost between a timed-out claim and the next
poll), and a long read keeps its claim by claiming again between batches. (These are the
transfer-engine connector's messages; the NIXL connector speaks its own over the same
server and client, and RENEW.)

:meth:`ControlClient.claim` is the receivers' claim loop over this channel (the one
claim-until-deadline loop, :mod:`~vllm_kvbridge.connectors.claim_loop`).

Long poll: a CLAIM (or the NIXL connector's GET, the same shape) that ends with
``hold_ms`` and finds nothing is not answered MISSING at once: the server holds it, and
answers it as soon as the key is put (the connector calls :meth:`ControlServer.key_put`)
or, at the latest, after ``hold_ms`` (MISSING). A receiver that asks before the sender's
put completes thus gets the key on arrival, not at its next retry (which backed off to
20 ms). At most :data:`MAX_HELD` requests are held; past that, MISSING at once, and the
receiver backs off as without a hold.

RENEW is the receiver's :meth:`~vllm_kvbridge.connectors.base.Connector.renew` (both
connectors, via :meth:`ControlClient.renew`): the sender moves an unclaimed key's expiry to
its ``lease_s`` from now and answers OK; a claimed key answers OK unchanged (its claim
lease governs it); a key it does not hold answers MISSING.
"""

from __future__ import annotations

import math
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from vllm_kvbridge.connectors.claim_loop import MISSING as MISSING_KEY
from vllm_kvbridge.connectors.claim_loop import Retry, claim_until_deadline, hold_seconds
from vllm_kvbridge.errors import ConnectorClosed, TransferError, TransferRefused, TransferTimeout

U64 = struct.Struct("<Q")
CLAIM, DONE, RENEW = b"CLAIM", b"DONE", b"RENEW"
OK, MISSING, TOOBIG, EXPIRED, BAD = b"OK", b"MISSING", b"TOOBIG", b"EXPIRED", b"BAD"
_MAX_IDLE = 8

#: ``handler(request_frames) -> answer_frames`` (without identity and nonce).
Handler = Callable[[list[bytes]], list[bytes]]
#: Requests a server holds at once (long poll); more are answered MISSING at once.
MAX_HELD = 256
#: Longest hold a receiver asks for: it asks again after that (and re-checks it is open).
LONG_POLL_S = 1.0
_HOLD_FIELDS = 5  # [verb, key, receiver, max_bytes, hold_ms]


def hold_field(deadline: float | None) -> list[bytes]:
    """The ``hold_ms`` frame for a claim whose receiver waits until ``deadline`` (none
    without a deadline: a single try)."""
    return _hold_frame(hold_seconds(deadline, LONG_POLL_S))


def _hold_frame(hold_s: float) -> list[bytes]:
    return [U64.pack(int(hold_s * 1000))] if hold_s else []


@dataclass
class _HeldRequest:
    identity: bytes
    nonce: bytes
    request: list[bytes]  # without the hold field: what the handler sees
    until: float


class ControlServer:
    """ROUTER socket + thread answering requests with ``handler``; ``tick`` runs every ``tick_s``."""

    def __init__(self, ctx: zmq.Context, host: str, port: int, advertise: str, handler: Handler) -> None:
        self._ctx = ctx
        self._handler = handler
        self._router = ctx.socket(zmq.ROUTER)
        self._router.linger = 0
        try:
            if port:
                self._router.bind(f"tcp://{host}:{port}")
            else:
                port = self._router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._router.close()
            raise TransferError(f"cannot bind the control socket on tcp://{host}:{port}: {exc}") from exc
        self.endpoint = f"tcp://{advertise}:{port}"
        wake = f"inproc://kvbridge-te-wake-{id(self)}"
        self._wake_recv = ctx.socket(zmq.PAIR)
        self._wake_recv.bind(wake)
        self._wake_send = ctx.socket(zmq.PAIR)
        self._wake_send.connect(wake)
        self._wake_lock = threading.Lock()  # key_put is called from any thread
        self._thread: threading.Thread | None = None
        self._held: dict[bytes, list[_HeldRequest]] = {}  # key -> held requests (server thread)
        self._held_count = 0
        #: requests answered or held so far (a receiver's poll loop shows as many)
        self.requests = 0

    def start(self, tick: Callable[[], None], tick_s: float) -> None:
        self._thread = threading.Thread(
            target=self._serve, args=(tick, tick_s), name="kvbridge-te-control", daemon=True
        )
        self._thread.start()

    def key_put(self, key: str) -> None:
        """``key`` was just put: answer the requests held for it (any thread; cheap when
        nobody waits, a message to the server thread otherwise)."""
        with self._wake_lock:
            if self._thread is not None:
                try:
                    self._wake_send.send(b"K" + key.encode("ascii"), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # closing, or the thread is far behind: the hold's timeout answers

    def _serve(self, tick: Callable[[], None], tick_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        next_tick = time.monotonic() + tick_s
        while True:
            wake_at = min([next_tick, *(h.until for held in self._held.values() for h in held)])
            # Rounded up: rounded down, the last millisecond before every tick was a
            # busy loop of poll(0) (a fifth of a core with the 5 ms tick, idle).
            events = dict(poller.poll(max(0, math.ceil((wake_at - time.monotonic()) * 1000))))
            if self._wake_recv in events and not self._take_wakes():
                return
            while self._router in events:
                try:
                    request = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(request) < 3 or len(request[2]) != 8:
                    continue  # not even a nonce to answer to
                self._answer(request[0], request[2], [request[1], *request[3:]])
            if self._held:
                self._expire_held()
            if time.monotonic() >= next_tick:
                tick()
                next_tick = time.monotonic() + tick_s

    def _answer(self, identity: bytes, nonce: bytes, request: list[bytes]) -> None:
        self.requests += 1
        hold_ms = 0
        if len(request) == _HOLD_FIELDS and len(request[4]) == 8:
            # At most LONG_POLL_S, whatever a peer asks: a held request takes a MAX_HELD slot.
            hold_ms, request = min(U64.unpack(request[4])[0], int(LONG_POLL_S * 1000)), request[:4]
        answer = self._handle(request)
        if answer == [MISSING] and hold_ms and self._held_count < MAX_HELD:
            held = _HeldRequest(identity, nonce, request, time.monotonic() + hold_ms / 1000)
            self._held.setdefault(request[1], []).append(held)
            self._held_count += 1
            return
        self._router.send_multipart([identity, nonce, *answer])

    def _handle(self, request: list[bytes]) -> list[bytes]:
        try:
            return self._handler(request)
        except Exception:  # a bad request never takes the server down
            return [BAD]

    def _take_wakes(self) -> bool:
        """Answer the held requests of the keys put since; False when told to stop."""
        while True:
            try:
                msg = self._wake_recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if not msg:
                return False
            waiting = self._held.pop(msg[1:], None)
            if not waiting:
                continue
            still = []
            for held in waiting:
                answer = self._handle(held.request)
                if answer == [MISSING]:  # another receiver claimed it: keep waiting
                    still.append(held)
                else:
                    self._held_count -= 1
                    self._router.send_multipart([held.identity, held.nonce, *answer])
            if still:
                self._held[msg[1:]] = still

    def _expire_held(self) -> None:
        now = time.monotonic()
        for key in list(self._held):
            kept = []
            for held in self._held[key]:
                if held.until <= now:
                    self._held_count -= 1
                    self._router.send_multipart([held.identity, held.nonce, MISSING])
                else:
                    kept.append(held)
            if kept:
                self._held[key] = kept
            else:
                del self._held[key]

    def close(self) -> None:
        with self._wake_lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._wake_send.send(b"")
        if thread is not None:
            thread.join(10)
        for sock in (self._router, self._wake_send, self._wake_recv):
            sock.close(linger=0)


def refuses_connections(endpoint: str, timeout: float = 0.5) -> bool:
    """True when nothing listens at ``tcp://host:port`` any more (the peer process is gone)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):  # unreachable / slow: not proof of death
        return False


class ControlClient:
    """Request/answer over pooled DEALER sockets, with nonces and dead-peer detection."""

    def __init__(self, ctx: zmq.Context, is_closed: Callable[[], bool]) -> None:
        self._ctx = ctx
        self._is_closed = is_closed
        self._lock = threading.Lock()
        self._idle: dict[str, list[zmq.Socket]] = {}
        self._nonce = 0

    def request(self, endpoint: str, frames: list[bytes], wait_until: float) -> list[bytes]:
        """Send ``[frames[0], nonce, *frames[1:]]``; the answer without the nonce.

        Raises :class:`TransferError` as soon as the peer refuses TCP connections (it is
        gone), :class:`TransferTimeout` when no answer came by ``wait_until``.
        """
        with self._lock:
            self._nonce += 1
            nonce = U64.pack(self._nonce)
        sock = self._checkout(endpoint)
        healthy = False
        try:
            sock.send_multipart([frames[0], nonce, *frames[1:]], zmq.NOBLOCK)
            next_probe = time.monotonic() + 0.05
            while True:
                now = time.monotonic()
                # Wake at least every 50 ms: close() and a dead peer are noticed promptly.
                if sock.poll(max(0, min(int((wait_until - now) * 1000) + 1, 50)), zmq.POLLIN):
                    answer = sock.recv_multipart()
                    if answer and answer[0] == nonce:
                        healthy = True
                        return answer[1:]
                    continue  # the answer to an earlier, timed-out request
                if self._is_closed():
                    raise ConnectorClosed("connector closed during a control request")
                now = time.monotonic()
                if now >= next_probe:
                    if refuses_connections(endpoint):
                        raise TransferError(
                            f"the sender at {endpoint} is gone (connection refused): "
                            "its payloads cannot be delivered"
                        )
                    next_probe = now + 1.0
                if now >= wait_until:
                    raise TransferTimeout(f"no answer from {endpoint} before the deadline")
        except zmq.ZMQError as exc:
            if self._is_closed():
                raise ConnectorClosed("connector closed during a control request") from None
            raise TransferError(f"control request to {endpoint} failed: {exc}") from exc
        finally:
            self._checkin(endpoint, sock, healthy)

    def claim(
        self,
        endpoint: str,
        key: str,
        request: list[bytes],
        deadline: float | None,
        *,
        fields: int,
        request_timeout_s: float,
        max_payload_bytes: int,
        check_open: Callable[[], None],
        taken: Callable[[list[bytes]], bool] = lambda answer: False,
    ) -> list[bytes] | None:
        """CLAIM (or NIXL's GET) ``key`` with ``request`` until it is claimed or ``deadline``
        passes (:func:`~vllm_kvbridge.connectors.claim_loop.claim_until_deadline`, each
        request held by the sender until the key is put): the OK answer's ``fields`` frames
        after OK; ``None`` if missing without a deadline. An OK answer that ``taken`` says
        this receiver consumed already counts as missing. :class:`TransferRefused` when the
        sender says the payload is over ``max_payload_bytes``, :class:`TransferError` for any
        other answer, as from :meth:`request`."""

        def attempt(hold_s: float, wait_until: float) -> list[bytes] | Retry:
            answer = self.request(endpoint, request + _hold_frame(hold_s), wait_until)
            status = answer[0] if answer else BAD
            if status == OK and len(answer) == fields + 1:
                return MISSING_KEY if taken(answer) else answer[1:]
            if status == TOOBIG and len(answer) == 2:
                raise TransferRefused(
                    f"{key!r} at {endpoint} is {U64.unpack(answer[1])[0]} bytes, over "
                    f"max_payload_bytes={max_payload_bytes}"
                )
            if status != MISSING:
                raise TransferError(f"{endpoint} answered {answer[:1]!r} to a claim of {key!r}")
            return MISSING_KEY

        return claim_until_deadline(
            attempt,
            deadline,
            not_there=f"{key!r} was not available at {endpoint} before the deadline",
            check_open=check_open,
            request_timeout_s=request_timeout_s,
            long_poll_s=LONG_POLL_S,
        )

    def renew(self, endpoint: str, key: str, timeout_s: float) -> bool:
        """RENEW ``key`` at ``endpoint``: True if the sender holds it, False if not.

        :class:`TransferError` (a :class:`TransferTimeout` included) when the sender does
        not answer within ``timeout_s`` or is gone.
        """
        answer = self.request(endpoint, [RENEW, key.encode("ascii")], time.monotonic() + timeout_s)
        if answer in ([OK], [MISSING]):
            return answer == [OK]
        raise TransferError(f"{endpoint} answered {answer!r} to a renewal of {key!r}")

    def _checkout(self, endpoint: str) -> zmq.Socket:
        with self._lock:
            if self._is_closed():
                raise ConnectorClosed("connector is closed")
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop()
            sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # answers are tiny; anything bigger is hostile
        sock.connect(endpoint)
        return sock

    def _checkin(self, endpoint: str, sock: zmq.Socket, healthy: bool) -> None:
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            # A socket whose request went unanswered may still get that answer: the nonce
            # check discards it, but a dead peer's socket is not worth keeping.
            if healthy and not self._is_closed() and len(idle) < _MAX_IDLE:
                idle.append(sock)
                return
        sock.close(linger=0)

    def close(self) -> None:
        with self._lock:
            socks = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in socks:
            sock.close(linger=0)


__all__ = ["LONG_POLL_S", "MAX_HELD", "ControlClient", "ControlServer", "hold_field", "refuses_connections"]
