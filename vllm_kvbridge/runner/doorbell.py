"""Doorbells: a payload receiver woken by the arrival of what it waits for, not by a timer.

A connector's ``get`` without a deadline only says "not there yet", so a receiver that
waits for many streams at once (:class:`~vllm_kvbridge.runner.payload_receiver.PayloadReceiver`)
polls them, backing off up to its ``max_poll_interval_s`` (20 ms): a payload that lands
while it sleeps is seen up to that late, about half of it on average (measured with
``vllm-kvbridge bench handoff``: 15 ms p50 for a 1 KB payload on shared memory, whose bare
transport takes 0.03 ms). A doorbell removes that wait, whatever the connector:

* the sender side (:class:`Bell`, one per
  :class:`~vllm_kvbridge.runner.payload_stream.PayloadSender`) is a UDP socket bound to
  loopback; its endpoint travels to receivers in the sender info (``metadata["bell"]``),
  with the connector's own metadata. After every put that landed it sends the put's key,
  one datagram, to each receiver that subscribed;
* the receiver side (:class:`BellListener`, one per receive thread) subscribes by sending
  one datagram to the bells named in its streams' metadata (the sender reads those before
  its next ring; closing unsubscribes the same way) and sleeps in
  :meth:`BellListener.wait`, which returns at once when a bell rings (with the keys rung)
  or another thread calls :meth:`BellListener.wake`.

Datagrams rather than a broker or ZMQ PUB/SUB: a ring is one ``sendto`` on the sender's I/O
thread and wakes the receiving thread directly (PUB/SUB adds an I/O thread on each side:
two more wake-ups, about 0.5 ms of the 1 KB handoff on an idle 2-core machine).

A bell is only a hint: the receiver still polls on its timer, so a ring that is lost (a
full socket buffer) costs the old latency, never a payload. Rings never block a put and
never raise. The endpoint names the sender's host and network namespace
(``udp://127.0.0.1:PORT?host=ID``, :func:`host_id`): a receiver elsewhere (another node,
another container) would reach its *own* loopback, so it does not subscribe and polls.
"""

from __future__ import annotations

import functools
import math
import os
import select
import socket
import threading
from collections import OrderedDict

#: The metadata key (sender info) carrying a sender's bell endpoint (``udp://host:port``).
BELL_KEY = "bell"
_SUBSCRIBE, _UNSUBSCRIBE = b"\0sub", b"\0unsub"
#: Receivers a bell remembers (the oldest is forgotten first: a gone receiver never says so).
MAX_SUBSCRIBERS = 256


@functools.cache
def host_id() -> str:
    """Who shares this process's loopback: the boot (one per host and boot) and the network
    namespace (containers of a host have their own loopback)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return "unknown"  # no /proc: matches only another process that cannot tell either
    return f"{boot}.{netns}"


def _parse(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of a bell on this host's loopback; None when malformed or elsewhere."""
    if not endpoint.startswith("udp://"):
        return None
    address, _, query = endpoint[len("udp://") :].partition("?host=")
    if query != host_id():
        return None
    host, _, port = address.rpartition(":")
    try:
        return host, int(port)
    except ValueError:
        return None


class Bell:
    """The sender side: :meth:`ring` after every put that landed (thread-safe, never raises)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._host = host
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._endpoint: str | None = None
        self._closed = False
        self._subscribers: OrderedDict[tuple[str, int], None] = OrderedDict()

    def endpoint(self) -> str | None:
        """Where receivers subscribe (bound on first use); None when closed or binding failed."""
        with self._lock:
            if self._sock is None and not self._closed:
                try:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    sock.bind((self._host, 0))
                    sock.setblocking(False)
                except OSError:
                    self._closed = True  # no bell: receivers poll, as before
                    return None
                self._sock = sock
                self._endpoint = f"udp://{self._host}:{sock.getsockname()[1]}?host={host_id()}"
            return None if self._closed else self._endpoint

    def ring(self, key: str) -> None:
        """Tell the subscribed receivers that ``key`` landed."""
        if self.endpoint() is None:
            return
        data = key.encode()
        with self._lock:
            sock = self._sock
            if sock is None:
                return
            self._take_subscriptions(sock)
            for addr in list(self._subscribers):
                try:
                    sock.sendto(data, addr)
                except OSError:
                    self._subscribers.pop(addr, None)  # gone (refused) or unreachable

    def _take_subscriptions(self, sock: socket.socket) -> None:
        # Lock held. Subscriptions queue in the socket until the next ring reads them.
        while True:
            try:
                msg, addr = sock.recvfrom(64)
            except OSError:
                return
            self._subscribers.pop(addr, None)
            if msg == _SUBSCRIBE:
                self._subscribers[addr] = None
                while len(self._subscribers) > MAX_SUBSCRIBERS:
                    self._subscribers.popitem(last=False)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class BellListener:
    """The receiver side. :meth:`subscribe` and :meth:`wait` belong to one thread (the
    receive loop); :meth:`wake` may be called from any."""

    def __init__(self) -> None:
        # A pipe, not an Event: one poll sleeps on the bells and on the other threads' wakes.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poll = select.poll()
        self._poll.register(self._wake_r, select.POLLIN)
        # The socket comes with the first bell: a receiver that never hears of one has none.
        self._sock: socket.socket | None = None
        self._subscribed: set[str] = set()
        self._closed = False

    def subscribe(self, endpoint: str) -> None:
        """Listen to the bell at ``endpoint`` (once per endpoint; a malformed one, one on
        another host or network namespace, or an unreachable one is not tried again: its
        payloads are found by polling)."""
        if endpoint in self._subscribed or self._closed:
            return
        self._subscribed.add(endpoint)
        addr = _parse(endpoint)
        if addr is None:
            return
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((addr[0], 0))
                sock.setblocking(False)
                self._sock = sock
                self._poll.register(sock.fileno(), select.POLLIN)
            self._sock.sendto(_SUBSCRIBE, addr)
        except OSError:
            pass

    def wake(self) -> None:
        """End the current or next :meth:`wait` (e.g. a stream was added)."""
        if self._closed:
            return  # the pipe's descriptors may belong to another file by now
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # the pipe is full (a wake is pending) or closed

    def wait(self, timeout: float) -> tuple[bool, list[str]]:
        """Sleep up to ``timeout`` seconds or until a bell rings or :meth:`wake` is called;
        ``(woken, keys)``: whether :meth:`wake` was called, and the keys rung meanwhile."""
        ready = {fd for fd, _ in self._poll.poll(max(0, math.ceil(timeout * 1000)))}
        keys: list[str] = []
        if self._sock is not None and self._sock.fileno() in ready:
            while True:
                try:
                    keys.append(self._sock.recv(1024).decode(errors="replace"))
                except OSError:
                    break
        woken = self._wake_r in ready
        if woken:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except OSError:
                pass
        return woken, keys

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            # So the senders stop ringing this port (another socket may get it next).
            for endpoint in self._subscribed:
                addr = _parse(endpoint)
                if addr is not None:
                    try:
                        self._sock.sendto(_UNSUBSCRIBE, addr)
                    except OSError:
                        pass
            self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
