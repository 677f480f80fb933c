"""The orchestrator's control plane, open only to the stage processes it started (issue 36).

:class:`ControlPlane` is the ROUTER socket every stage process connects to, on every
transport the orchestrator uses (loopback included): a CURVE server that admits exactly
the keypairs it issued, one per stage *process* (:meth:`ControlPlane.issue` at each spawn,
:meth:`ControlPlane.revoke` once the process is given up). Why CURVE rather than a MAC
over each frame: a peer that fails the handshake never becomes a ROUTER peer, so it can
neither send a frame the orchestrator reads nor claim a stage's routing id and receive
that stage's requests; and the control messages (prompts, outputs) are encrypted where
they cross hosts.

A stage process gets its :class:`StageCredentials` (its keypair, the orchestrator's public
key to pin, an unguessable routing id) on stdin ahead of its config, never in argv (``ps``
shows it) nor its environment: the orchestrator hands them to the backend in the spawn's
``env`` under :data:`CREDENTIALS_ENV`, and ``stage_handles.start_stage_process`` moves them
from there to the child's stdin (locally, or on its node in the Ray actor).

:meth:`ControlPlane.receive` lets through only a frame that decodes to a stage message
whose ``stage_id`` is the stage the sender's key was issued for, tagged with that key (so
the orchestrator also tells a process it replaced from the current one); anything else is
dropped and counted, never raised: nothing a peer sends can stop the orchestrator's loop.
Failed handshakes are counted too (the socket's monitor): :meth:`ControlPlane.counters`.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_kvbridge.errors import KVBridgeError
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.results import PipelineError

__all__ = [
    "CREDENTIALS_ENV",
    "ControlPlane",
    "Received",
    "StageCredentials",
    "credentials_from",
    "given_to_sender",
    "new_request_id",
    "read_credentials",
]

#: The key of the spawn ``env`` that carries a stage process's credentials to
#: ``start_stage_process``, which takes them out and writes them on the child's stdin.
CREDENTIALS_ENV = "KVBRIDGE_CONTROL_CREDENTIALS"

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def new_request_id(prefix: str = "req") -> str:
    """``<prefix>-<16 hex digits>``: 64 random bits, so an id seen nowhere cannot be guessed
    (ids name the request's KV and payload keys on the data plane, too)."""
    return f"{prefix}-{secrets.token_hex(8)}"


class StageUnreachable(KVBridgeError):
    """The stage process a message is for is not connected to the control plane."""


class StageCredentials(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one stage process needs to reach its orchestrator, and nobody else has."""

    stage_id: int
    #: ZMQ routing id of the process's main socket: the orchestrator's messages to the
    #: stage go there (random: a peer cannot claim it, a successor never collides).
    route: str
    #: the process's CURVE keypair (z85)
    public: str
    secret: str
    #: the orchestrator's public key (z85), pinned: the process talks to that server only
    server: str

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    def in_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` for a backend's ``spawn``, carrying these credentials to
        ``start_stage_process`` (which moves them to the child's stdin)."""
        return {**env, CREDENTIALS_ENV: self.encode()}

    @classmethod
    def decode(cls, raw: str | bytes) -> StageCredentials:
        return msgspec.json.decode(raw, type=cls)

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the orchestrator with this keypair (before connect)."""
        sock.curve_serverkey = self.server.encode()
        sock.curve_publickey = self.public.encode()
        sock.curve_secretkey = self.secret.encode()


@dataclass(frozen=True)
class Received:
    """A message the control plane let through: sent by a process holding ``key``, issued
    for stage ``stage_id`` (which is also the message's ``stage_id``)."""

    stage_id: int
    key: str
    msg: m.FromStage


class _Admitted:
    """The ZAP credentials provider: a client key is admitted while it is issued and not
    revoked. Called on the authenticator's thread; the set is replaced, never changed in
    place, so that thread never sees it half-updated."""

    def __init__(self) -> None:
        self.keys: frozenset[bytes] = frozenset()

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class ControlPlane:
    """The orchestrator's end of the control plane (see the module docstring).

    Bound on ``host`` (the backend's ``control_host``) at a random port. Everything but
    :meth:`counters` belongs to one thread (the orchestrator's loop), like any ZMQ socket."""

    COUNTERS = ("refused_connections", "dropped_frames")

    def __init__(self, host: str) -> None:
        if not zmq.has("curve"):
            raise PipelineError("the control plane needs a libzmq with CURVE (pyzmq's wheels have it)")
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = zmq.curve_keypair()
        self.server_key = public.decode()
        self.ctx = zmq.Context()
        self._auth = ThreadAuthenticator(self.ctx)
        self._auth.start()
        self._admitted = _Admitted()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self._admitted)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A stage process that reconnects (its TCP connection dropped) keeps its routing id.
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.curve_server = True
        self.sock.curve_publickey = public
        self.sock.curve_secretkey = secret
        self._monitor = self.sock.get_monitor_socket(_HANDSHAKE_FAILED)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.address = f"tcp://{host}:{self.sock.bind_to_random_port(f'tcp://{host}')}"
        #: client key -> the stage it was issued for; revoked keys stay, so that what a
        #: replaced process still had queued is told from an impostor's words.
        self._owners: dict[str, int] = {}
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.COUNTERS, 0)
        #: why the last frame was dropped (for a log line or a debugger, not an API)
        self.last_dropped = ""

    # -- keys -------------------------------------------------------------------------------
    def issue(self, stage_id: int) -> StageCredentials:
        """A new keypair for a process of stage ``stage_id``, admitted from now on."""
        public, secret = zmq.curve_keypair()
        creds = StageCredentials(
            stage_id,
            f"stage-{stage_id}-{secrets.token_hex(8)}",
            public.decode(),
            secret.decode(),
            self.server_key,
        )
        self._owners[creds.public] = stage_id
        self._admitted.keys = self._admitted.keys | {public}
        return creds

    def revoke(self, key: str) -> None:
        """Refuse new connections with ``key`` (its process was given up). A connection it
        still has is not cut here: the process is killed, and what it sent is told apart
        by its key (:attr:`Received.key`)."""
        self._admitted.keys = self._admitted.keys - {key.encode()}

    # -- traffic ----------------------------------------------------------------------------
    def poll(self, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for a frame or a failed handshake; whether one came."""
        return bool(self._poller.poll(timeout_ms))

    def receive(self) -> Received | None:
        """The next frame that passes (see the module docstring), or None when none is
        waiting. Frames that do not pass are dropped and counted on the way."""
        self._count_refused()
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            got = self._vet(frames)
            if got is not None:
                return got

    def send(self, route: bytes, msg: m.ToStage, *, block: bool = True) -> None:
        """Send ``msg`` to the stage process whose routing id is ``route``.

        :class:`StageUnreachable` when that process is not connected (it died, or its
        connection dropped, before the orchestrator noticed): with ``ROUTER_MANDATORY`` the
        socket says so (EHOSTUNREACH) rather than dropping the message unseen."""
        try:
            self.sock.send_multipart([route, m.encode(msg)], flags=0 if block else zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            name = route.decode(errors="replace")
            raise StageUnreachable(f"the stage process {name!r} is not connected") from None

    def counters(self) -> dict[str, int]:
        """``refused_connections``: handshakes that failed (no key, or one not issued or
        revoked: such a peer's frames are never read); ``dropped_frames``: frames of an
        admitted process that did not decode to a stage message of its own stage. Safe
        from any thread."""
        with self._lock:
            return dict(self._counts)

    def drop(self, why: str) -> None:
        """Count a frame dropped (also for the orchestrator's own checks of a message)."""
        with self._lock:
            self._counts["dropped_frames"] += 1
        self.last_dropped = why

    def _vet(self, frames: list[zmq.Frame]) -> Received | None:
        if len(frames) != 2:  # [routing id, payload]: a DEALER sends one frame per message
            self.drop(f"{len(frames) - 1} frames in one message")
            return None
        try:
            key = frames[1].get("User-Id")  # the client key the ZAP handler admitted
        except zmq.ZMQError:
            key = ""
        owner = self._owners.get(key)
        if owner is None:  # cannot be, short of a libzmq without ZAP: never believe it
            self.drop("a frame of an unknown peer")
            return None
        try:
            msg = m.check_from_stage(m.decode_from_stage(frames[1].bytes))
        except ValueError as exc:  # msgspec's DecodeError is one
            self.drop(f"a frame of stage {owner}'s process that does not decode: {exc}")
            return None
        if msg.stage_id != owner:
            self.drop(f"stage {owner}'s process spoke for stage {msg.stage_id}")
            return None
        return Received(owner, key, msg)

    def _count_refused(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] & _HANDSHAKE_FAILED:
                with self._lock:
                    self._counts["refused_connections"] += 1

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(0)
        self.sock.close(0)
        self._auth.stop()
        self.ctx.term()


def given_to_sender(msg: m.FromStage, results: Mapping[str, Any], replica: int = 0) -> bool:
    """Whether ``msg`` (from its own stage: :class:`Received`; of its ``replica``) concerns
    only what that process was given: a request it reports on was submitted to that
    replica of the stage (``results``: request id ->
    :class:`~vllm_kvbridge.pipeline.results.RequestResult`). A request the orchestrator
    no longer knows passes: its late words are ignored anyway (it finished and was handed
    back)."""
    rid = getattr(msg, "request_id", None)
    r = results.get(rid) if rid is not None else None
    return r is None or any(x.stage_id == msg.stage_id and x.replica == replica for x in r.stages)


def credentials_from(env: Mapping[str, str]) -> tuple[bytes, dict[str, str]]:
    """``env`` without :data:`CREDENTIALS_ENV`, and that entry as the line a stage process
    reads first on its stdin (``stage_handles.start_stage_process``)."""
    rest = dict(env)
    raw = rest.pop(CREDENTIALS_ENV, None)
    if not raw:
        raise PipelineError("a stage process needs control-plane credentials (ControlPlane.issue)")
    StageCredentials.decode(raw)  # a malformed one fails here, not in the child
    return raw.encode() + b"\n", rest


def read_credentials(stream: Any) -> StageCredentials:
    """The credentials line a stage process reads first on its stdin."""
    return StageCredentials.decode(stream.readline())
