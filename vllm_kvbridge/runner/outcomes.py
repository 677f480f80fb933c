"""Transfer outcomes, pushed by the workers to their stage engine as they happen.

Why: the stage reports a finished request to the orchestrator only once its sends settled
(and with the sender info the consumer needs). It used to ask every worker over vLLM's
``collective_rpc`` every few milliseconds and parse status strings. vLLM's own channels do
not reach that far: a request's ``kv_transfer_params`` leave with its last output, before
our KV send (which runs after it, from blocks vLLM holds for us) settles, and nothing in
vLLM's output carries word from a worker after that. So each worker *pushes* a typed
:class:`TransferOutcome` when a transfer starts and when it settles, and the stage engine
waits on its :class:`OutcomeInbox` instead of polling.

Wiring: the stage engine binds an inbox on loopback and names it in :data:`OUTCOMES_ENV`
(``<endpoint>#<token>``: a message without the token is dropped, so another local process
cannot report a transfer done) while it builds its vLLM engine; vLLM's processes inherit
the environment, and each worker process pushes through one :func:`pusher` (a ZMQ PUSH
socket, connected on first use). A worker with no inbox in its environment (a stock
``vllm serve``, a test engine) pushes nothing: ``kvbridge_transfer_status`` still
answers, for tests and debugging.

Messages are msgspec structs (no pickle); ``status`` is a
:class:`~vllm_kvbridge.runner.transfer_status.TransferStatus` value.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

#: The environment variable that names the stage engine's inbox to its vLLM processes.
OUTCOMES_ENV = "VLLM_KVBRIDGE_OUTCOMES"


class TransferOutcome(msgspec.Struct, frozen=True):
    """One rank's word on one transfer of a request."""

    transfer_id: str
    rank: int
    #: "kv" (every rank, from its KV sender) or "payload" (the payload rank, its flows)
    what: str
    #: TransferStatus value: pending (started), done, failed, aborted, none (nothing sent)
    status: str
    reason: str = ""
    aborted: bool = False
    #: sender info: a KV send's put metadata per key; the payload edges' receiver info
    info: dict[str, Any] = {}
    #: the worker process (TP ranks of several PP stages share ``rank``); the pusher sets it
    pid: int = 0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(TransferOutcome)


class OutcomePusher:
    """A worker's push socket to its stage's inbox (thread-safe; the I/O threads push)."""

    def __init__(self, address: str | None) -> None:
        #: ``<endpoint>#<token>`` from :data:`OUTCOMES_ENV` (None: push nothing)
        self.address = address
        self.endpoint, _, token = (address or "").partition("#")
        self._token = token.encode()
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None

    def push(self, outcome: TransferOutcome) -> None:
        if not self.endpoint:
            return
        data = _ENCODER.encode(msgspec.structs.replace(outcome, pid=self.pid))
        with self._lock:
            if self._sock is None:
                self._ctx = zmq.Context()
                self._sock = self._ctx.socket(zmq.PUSH)
                self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop: the stage waits for it
                # At exit, what is queued gets half a second (vLLM kills a worker ~5 s after
                # asking it to stop, and the shutdown itself has 3 s of that).
                self._sock.setsockopt(zmq.LINGER, 500)
                self._sock.connect(self.endpoint)
            self._sock.send_multipart([self._token, data], copy=True)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None


_PUSHER: OutcomePusher | None = None
_PUSHER_LOCK = threading.Lock()


def pusher() -> OutcomePusher:
    """This process's pusher (to the inbox in :data:`OUTCOMES_ENV`, or a no-op)."""
    global _PUSHER
    with _PUSHER_LOCK:
        address = os.environ.get(OUTCOMES_ENV)
        # A forked child never uses its parent's socket.
        if _PUSHER is None or _PUSHER.address != address or _PUSHER.pid != os.getpid():
            _PUSHER = OutcomePusher(address)
        return _PUSHER


class OutcomeInbox:
    """The stage engine's end: a PULL socket bound on loopback."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._token = secrets.token_hex(16).encode()
        #: what the workers find in :data:`OUTCOMES_ENV`
        self.address = f"tcp://{host}:{port}#{self._token.decode()}"

    def take(self, timeout_s: float = 0.0) -> list[TransferOutcome]:
        """Every outcome that arrived, waiting up to ``timeout_s`` for the first."""
        out: list[TransferOutcome] = []
        if timeout_s > 0 and not self._sock.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return out
            if len(frames) != 2 or not secrets.compare_digest(frames[0], self._token):
                logger.error("kvbridge: dropped a transfer outcome without this stage's token")
                continue
            try:
                out.append(_DECODER.decode(frames[1]))
            except msgspec.DecodeError as exc:  # never the stage
                logger.error("kvbridge: dropped a malformed transfer outcome: %s", exc)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


__all__ = ["OUTCOMES_ENV", "OutcomeInbox", "OutcomePusher", "TransferOutcome", "pusher"]
