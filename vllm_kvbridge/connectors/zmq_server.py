"""The serving half of :class:`~vllm_kvbridge.connectors.zmq_p2p.ZmqConnector`.

:class:`PayloadStore` holds what a sender put (frames in its memory and their sizes, in
the one held table of the pull connectors, :mod:`~vllm_kvbridge.connectors.held_table`:
TTLs, renewals, the bytes in flight) and the GETs the server holds for keys not put yet;
:class:`ZmqServer` owns the ROUTER socket and its thread and answers the wire protocol
described in :mod:`~vllm_kvbridge.connectors.zmq_p2p`. The receiving half (the client
socket pool, the GET/ACK exchange, decoding) stays in the connector.

Long-poll: a GET may ask to be held (``hold_ms``). The store registers it in the same
critical section in which it found the key missing, and a put checks for held GETs in the
critical section in which it stores the key, so a put is never missed: either the GET saw
the entry, or the put saw the waiter and wakes the server thread (an inproc PAIR socket)
to answer it. A held GET whose hold runs out is answered ``MISSING``.
"""

from __future__ import annotations

import math
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from vllm_kvbridge.connectors.held_table import Held, HeldTable, Refusal

U64 = struct.Struct("<Q")
GET, OK, DATA, MISSING, TOOBIG, BAD = b"GET", b"OK", b"DATA", b"MISSING", b"TOOBIG", b"BAD"
ACK, ACKED, RENEW = b"ACK", b"ACKED", b"RENEW"
#: The longest a server holds one GET for a key not there yet (the receiver asks again).
LONG_POLL_S = 1.0
#: GETs a server holds at once; beyond, "missing" is answered at once (the receiver backs off).
MAX_WAITERS = 4096


@dataclass
class Frames:
    """What a held entry of the ZMQ sender is (:mod:`~vllm_kvbridge.connectors.held_table`)."""

    frames: list[Any]
    sizes: bytes  # u64 le per frame, as the OK header carries them


Entry = Held[Frames]


@dataclass
class Waiter:
    """A GET held until its key is put or ``expires`` (monotonic) passes."""

    identity: bytes
    nonce: bytes
    limit: int
    expires: float


class PayloadStore:
    """What a sender serves (its held table, confirmed entries dropped, none claimed), and
    the GETs held for it. Thread-safe."""

    def __init__(self, ttl_s: float, lease_s: float, max_inflight_bytes: int) -> None:
        self._table: HeldTable[Frames] = HeldTable(
            ttl_s, lease_s, max_inflight_bytes, budget_option="max_inflight_bytes"
        )
        # The table's own (reentrant) lock: finding a key missing and holding a GET for it
        # are one step, as are storing a key and looking for the GETs held for it.
        self._lock = self._table.lock
        self._waiters: dict[str, list[Waiter]] = {}
        self._num_waiters = 0

    def add(self, key: str, frames: list[Any], sizes: list[int]) -> tuple[Refusal | None, bool]:
        """Hold ``frames`` under ``key``: ``(refusal, awaited)``, ``awaited`` whether a held
        GET wants the key (the server must be woken)."""
        packed = b"".join(U64.pack(n) for n in sizes)
        with self._lock:
            refused = self._table.add(key, Frames(frames, packed), sum(sizes))
            return refused, refused is None and key in self._waiters

    def lookup_or_wait(self, key: str, waiter: Waiter | None) -> tuple[Entry | None, bool]:
        """The entry of ``key``; when missing, hold ``waiter`` if given and there is room:
        ``(entry, held)``."""
        with self._lock:
            entry = self._table.get(key)
            if entry is None and waiter is not None and self._num_waiters < MAX_WAITERS:
                self._waiters.setdefault(key, []).append(waiter)
                self._num_waiters += 1
                return None, True
            return entry, False

    def due_waiters(self) -> list[tuple[Waiter, Entry | None]]:
        """Take the held GETs whose key is there (with its entry) or whose hold ran out (None)."""
        now = time.monotonic()
        due: list[tuple[Waiter, Entry | None]] = []
        with self._lock:
            for key in list(self._waiters):
                entry = self._table.get(key)
                keep = []
                for w in self._waiters[key]:
                    if entry is not None or w.expires <= now:
                        due.append((w, entry))
                    else:
                        keep.append(w)
                self._num_waiters -= len(self._waiters[key]) - len(keep)
                if keep:
                    self._waiters[key] = keep
                else:
                    del self._waiters[key]
        return due

    def next_waiter_expiry(self) -> float:
        with self._lock:
            return min((w.expires for ws in self._waiters.values() for w in ws), default=math.inf)

    def renew(self, key: str) -> bool:
        return self._table.renew(key)

    def drop(self, key: str) -> bool:
        """Forget ``key`` (confirmed by its receiver, or cleaned up); whether it was held."""
        return self._table.drop(key) is not None

    def expire(self) -> None:
        """Drop payloads unread past their TTL or lease (their frames go with them)."""
        self._table.sweep()

    def counts(self) -> dict[str, int]:
        with self._lock:
            held = self._table.counts()
            return {
                "held_payloads": held["held"],
                "inflight_bytes": held["held_bytes"],
                "held_gets": self._num_waiters,
                "expired": held["expired"],
            }

    def clear(self) -> None:
        with self._lock:
            self._table.clear()
            self._waiters.clear()
            self._num_waiters = 0


class ZmqServer:
    """The ROUTER socket of a sender and the thread answering it (bound by :meth:`start`)."""

    def __init__(self, ctx: zmq.Context, store: PayloadStore, sweep_every: float) -> None:
        self._ctx, self.store, self._sweep_every = ctx, store, sweep_every
        self._wake_lock = threading.Lock()  # the sending end is used by every putting thread
        self._wake_send: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None

    def start(self, router: zmq.Socket) -> None:
        """Serve on ``router`` (bound, secured) from a new thread until :meth:`close`."""
        wake_addr = f"inproc://kvbridge-wake-{id(self)}"
        wake_recv = self._ctx.socket(zmq.PAIR)
        wake_recv.bind(wake_addr)
        self._wake_send = self._ctx.socket(zmq.PAIR)
        self._wake_send.connect(wake_addr)
        self._router = router
        self._thread = threading.Thread(
            target=self._serve, args=(router, wake_recv), name="kvbridge-zmq-server", daemon=True
        )
        self._thread.start()

    def key_put(self) -> None:
        """A key that a held GET waits for was put: answer it now."""
        self._signal(b"k")

    def close(self, timeout: float = 10.0) -> None:
        self._signal(b"")
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        with self._wake_lock:
            wake_send, self._wake_send = self._wake_send, None
        for sock in (self._router, wake_send):
            if sock is not None:
                sock.close(linger=0)

    def _signal(self, what: bytes) -> None:
        with self._wake_lock:
            if self._wake_send is not None:
                try:
                    # A put's signal never blocks: a full queue already holds one to wake on.
                    self._wake_send.send(what, 0 if what == b"" else zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # closing: the server goes away with its held GETs

    def _serve(self, router: zmq.Socket, wake: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        next_sweep = time.monotonic() + self._sweep_every
        try:
            while True:
                next_expiry = self.store.next_waiter_expiry()
                timeout_ms = max(0, math.ceil((min(next_sweep, next_expiry) - time.monotonic()) * 1000))
                events = dict(poller.poll(timeout_ms))
                if wake in events and _drain_wake(wake):
                    return
                if wake in events or time.monotonic() >= next_expiry:
                    for w, entry in self.store.due_waiters():
                        self._reply_get(router, w.identity, w.nonce, w.limit, entry)
                if router in events:
                    # Drain what is queued: one poll per burst of requests.
                    while True:
                        try:
                            request = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._answer(router, request)
                if time.monotonic() >= next_sweep:
                    self.store.expire()
                    next_sweep = time.monotonic() + self._sweep_every
        except zmq.ContextTerminated:
            pass
        finally:
            wake.close(linger=0)

    def _answer(self, router: zmq.Socket, request: list[bytes]) -> None:
        send: Callable[[list[bytes]], None] = router.send_multipart
        if len(request) == 4 and request[1] in (ACK, RENEW) and len(request[2]) == 8:
            key = request[3].decode("ascii", "replace")
            if request[1] == ACK:
                self.store.drop(key)
                send([request[0], request[2], ACKED])
            else:
                send([request[0], request[2], OK if self.store.renew(key) else MISSING])
            return
        if len(request) not in (5, 6) or request[1] != GET or len(request[2]) != 8 or len(request[4]) != 8:
            if len(request) >= 3:
                send([request[0], request[2][:8], BAD])
            return
        identity, _, nonce, key_raw, max_raw, *hold = request
        limit = U64.unpack(max_raw)[0]
        hold_s = min(U64.unpack(hold[0])[0] / 1000, LONG_POLL_S) if hold and len(hold[0]) == 8 else 0.0
        waiter = Waiter(identity, nonce, limit, time.monotonic() + hold_s) if hold_s > 0 else None
        entry, held = self.store.lookup_or_wait(key_raw.decode("ascii", "replace"), waiter)
        if not held:
            self._reply_get(router, identity, nonce, limit, entry)

    @staticmethod
    def _reply_get(
        router: zmq.Socket, identity: bytes, nonce: bytes, limit: int, entry: Entry | None
    ) -> None:
        if entry is None:
            router.send_multipart([identity, nonce, MISSING])
        elif entry.nbytes > limit:
            router.send_multipart([identity, nonce, TOOBIG, U64.pack(entry.nbytes)])
        else:
            # The entry stays until the receiver confirms (or its TTL): a receiver that
            # gives up mid-transfer can ask again. copy=False: libzmq reads the tensors'
            # memory directly and pyzmq keeps it alive even if the entry goes meanwhile.
            router.send_multipart([identity, nonce, OK, entry.value.sizes])
            router.send_multipart([identity, nonce, DATA, *entry.value.frames], copy=False)


def _drain_wake(wake: zmq.Socket) -> bool:
    """Read every pending signal; whether one of them was close."""
    closing = False
    while True:
        try:
            closing = wake.recv(zmq.NOBLOCK) == b"" or closing
        except zmq.Again:
            return closing
