"""Cross-host transport on NIXL (UCX by default): the receiver READs the sender's registered memory.

This is the shape of vLLM's own ``NixlConnector``: one-sided reads of registered memory,
a small side channel for the metadata, and a NIXL notification that tells the producer
its memory may be reused. It runs over UCX's ``tcp`` and ``cma`` (shared-memory) transports
here; on hosts with RDMA NICs the same code reads over ``rc`` (see docs/multi_host.md).

Sender (:meth:`NixlConnector.put`): the payload is encoded and packed with one copy
(:meth:`Encoded.pack_into`) straight into a slab of a pool of registered host buffers
(:class:`~vllm_kvbridge.connectors.registered_pool.RegisteredBufferPool`), and *published*
under ``key``. The side channel is :class:`~vllm_kvbridge.connectors.te_control.ControlServer`
(a ZMQ ROUTER on a server thread, shared with the transfer-engine connector; its address is
``PutResult.metadata["endpoint"]``, next to the agent name); its tick every 5 ms takes the
agent's notifications and expires payloads.

Receiver (:meth:`NixlConnector.get`): asks the side channel for ``key`` (the pull connectors'
one claim loop: :meth:`~vllm_kvbridge.connectors.te_control.ControlClient.claim`). The answer claims
the payload for this receiver (a key is read once; the same receiver asking again gets the
same claim) and gives ``(address, nbytes, lease left, token)`` plus the
generation of the sender's registrations; the receiver (re)loads the sender's NIXL agent
metadata when it is older than that, READs the bytes into a slab of its own registered
pool with the token as the transfer's notification, and decodes them in place: the
returned tensors are views of the slab, which goes back to the pool when the last of them
is freed. When the notification arrives, the sender returns its slab to its pool.

Lifetimes (nothing stays registered or held; the sender's bookkeeping is the pull
connectors' one held table, :mod:`~vllm_kvbridge.connectors.held_table`):
  * a published payload nobody claims is released after ``ttl_s``, unless a receiver still
    waiting for it RENEWs it (:meth:`NixlConnector.renew`): each renewal moves its expiry
    to ``lease_s`` from then; ``health()["expired"]`` counts those released unread this
    way. ``cleanup(key)`` releases it at once;
  * a claimed payload stays registered until its notification (or the reader's NACK)
    arrives, or until its lease (``lease_s``) ends (a receiver that died mid-read): its slab
    is then unregistered and never reused. The receiver never reads past 80% of the lease
    it was given (nor past ``transfer_timeout_s``): a READ that has not finished by then
    fails (and its local slab is never reused), so the sender cannot reuse memory a reader
    is still copying;
  * ``close()`` stops the server, deregisters every slab and destroys the agent. Tensors
    a get returned stay valid (their memory is plain host memory).

Failures: a sender that is gone (its side channel refuses connections) is a
:class:`TransferError` at once; one that does not answer (stopped, unreachable) a
:class:`TransferTimeout` at the deadline (``request_timeout_s`` without one); a READ that
NIXL fails (the peer died after the claim) raises :class:`TransferError`; an oversize
payload is refused before any byte moves (:class:`TransferRefused`); bytes that do not
decode raise :class:`TransferCorrupt`.

Side channel (ZMQ multipart; ``nonce`` pairs a reply with its request; integers u64 le)::

    [b"GET", nonce, key, receiver(8), max_bytes(, hold_ms)]   (held until put: te_control)
        -> [nonce, b"OK", agent, addr, nbytes, gen, dgen, lease_left_ms, token]
         | [nonce, b"MISSING"] | [nonce, b"TOOBIG", nbytes] | [nonce, b"BAD"]
    [b"MD", nonce]           -> [nonce, b"MD", agent, metadata, gen, dgen]
    [b"NACK", nonce, token]  -> [nonce, b"OK"]  (the claimed READ failed: release it now)
    [b"RENEW", nonce, key]   -> [nonce, b"OK"] | [nonce, b"MISSING"]  (te_control's RENEW)

``metadata`` is NIXL's own agent metadata (NIXL parses it; no pickle crosses processes).

Config keys: ``host`` (127.0.0.1; where the side channel binds), ``port`` (0: ephemeral),
``advertise_host`` (address put in the metadata; default ``host``, or this host's name when
binding 0.0.0.0), ``backends`` (``["UCX"]``), ``backend_params`` (per backend, NIXL init
params), ``ucx_tls`` (``"cma,tcp"``), ``ucx_modules`` (``"^ib"``; see
:func:`~vllm_kvbridge.connectors.nixl_agent.prepare_ucx_env`), ``ttl_s`` (300), ``lease_s``
(60: a claim's lease, and what one renewal grants a published key; every put's metadata
says it), ``transfer_timeout_s`` (30), ``request_timeout_s`` (5; also bounds a renew),
``buffer_pool_bytes`` (512 MiB kept registered per side), ``max_payload_bytes`` (64 GiB),
``max_held_bytes`` (8 GiB of published payloads at once: a put over it is refused with
``PutResult.full``, and the sender waits for room), ``progress_delay_us`` (1000: how long
NIXL's progress thread sleeps when nothing wakes it; 0 is NIXL's own busy loop, a core per
agent, see :func:`~vllm_kvbridge.connectors.nixl_agent.new_agent`), ``limits`` (decoding).
"""

from __future__ import annotations

import os
import socket as pysocket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import zmq

from vllm_kvbridge.connectors.base import (
    DEFAULT_LEASE_S,
    Connector,
    Due,
    LentReservation,
    Meta,
    PutResult,
    Stage,
    number_option,
    offset_port,
    parse_size,
)
from vllm_kvbridge.connectors.held_table import Held, HeldTable
from vllm_kvbridge.connectors.nixl_agent import (
    DEFAULT_PROGRESS_DELAY_US,
    DEFAULT_UCX_MODULES,
    DEFAULT_UCX_TLS,
    NixlAgent,
    close_at_exit,
    closed_normally,
    prepare_ucx_env,
)
from vllm_kvbridge.connectors.registered_pool import RegisteredBufferPool
from vllm_kvbridge.connectors.te_control import RENEW, ControlClient, ControlServer
from vllm_kvbridge.errors import (
    ConfigError,
    PayloadError,
    TransferCorrupt,
    TransferError,
    TransferRefused,
    TransferTimeout,
)

_U64 = struct.Struct("<Q")
_GET, _MD, _NACK = b"GET", b"MD", b"NACK"
_OK, _MISSING, _TOOBIG, _BAD = b"OK", b"MISSING", b"TOOBIG", b"BAD"
_TOKEN_PREFIX = b"kvbridge:"
#: How often the server thread looks for READ notifications and expired payloads.
_TICK_S = 0.005
#: How long a receiver waits for the sender to acknowledge a failed READ (best effort).
_NACK_WAIT_S = 0.5
#: The share of a lease a receiver may spend reading (the rest covers clock rate and latency).
_LEASE_SHARE = 0.8
#: Tokens of completed READs a receiver remembers (only until the sender saw the notification).
_MAX_CONSUMED = 4096


def _u64(frame: bytes) -> int:
    return _U64.unpack(frame)[0]


def _new_token() -> bytes:
    """A claim's id, and the notification its READ carries."""
    return _TOKEN_PREFIX + os.urandom(12).hex().encode()


class NixlConnector(Connector):
    """One-sided READs of registered memory over NIXL; see the module docstring."""

    name = "NixlConnector"
    data_outlives_sender = False  # it is read from the sender's registered memory

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        # Everything _close() touches exists before anything can fail.
        self._lock = threading.Lock()
        # Published payloads (registered slabs), then lent to one reader under a token until
        # its notification; limits set below. A key may be put again while its last claim
        # waits for its notification (which trails the reader's get).
        self._table: HeldTable[np.ndarray] = HeldTable(
            0.0, 0.0, 0, keys_reusable_while_claimed=True, claim_id=_new_token, on_expired=self._expired_slab
        )
        self._quarantine: list[np.ndarray] = []  # local slabs a failed READ may still write
        # Claims this receiver READ to the end: until the sender has seen the notification it
        # would answer a second get of the key with the same claim (gets are destructive),
        # and a renew with OK. By token, and by (endpoint, key) for renew.
        self._consumed: OrderedDict[bytes | tuple[str, str], None] = OrderedDict()
        self._control: ControlServer | None = None
        self._client: ControlClient | None = None
        self._receiver_id = os.urandom(8)
        self._agent: NixlAgent | None = None
        self._pool: RegisteredBufferPool | None = None
        self.endpoint: str | None = None

        cfg = self.config
        self.host = str(cfg.get("host", "127.0.0.1"))
        self.port = number_option(cfg, "port", 0, int)
        advertise = cfg.get("advertise_host")
        if advertise is None:
            advertise = pysocket.gethostname() if self.host in ("0.0.0.0", "*") else self.host
        self.advertise_host = str(advertise)
        backends = cfg.get("backends", ["UCX"])
        if isinstance(backends, str):
            backends = [backends]
        if not backends or not all(isinstance(b, str) and b for b in backends):
            raise ConfigError(
                f"connector option 'backends' must be a list of NIXL backend names, got {backends!r}"
            )
        self.ttl_s = number_option(cfg, "ttl_s", 300.0)
        self.lease_s = number_option(cfg, "lease_s", DEFAULT_LEASE_S)
        self._sweep_every = max(0.01, min(self.ttl_s / 4, self.lease_s / 4, 1.0))
        self._next_sweep = 0.0
        self.transfer_timeout_s = number_option(cfg, "transfer_timeout_s", 30.0)
        self.request_timeout_s = number_option(cfg, "request_timeout_s", 5.0)
        self.max_payload_bytes = parse_size(cfg.get("max_payload_bytes", 64 << 30), "max_payload_bytes")
        self.max_held_bytes = parse_size(cfg.get("max_held_bytes", 8 << 30), "max_held_bytes")
        self._table.set_limits(self.ttl_s, self.lease_s, self.max_held_bytes)
        pool_bytes = parse_size(cfg.get("buffer_pool_bytes", 512 << 20), "buffer_pool_bytes")
        self._limits = cfg.get("limits")
        self.ucx_env = prepare_ucx_env(
            cfg.get("ucx_tls", DEFAULT_UCX_TLS), cfg.get("ucx_modules", DEFAULT_UCX_MODULES)
        )
        self._ctx = zmq.Context()
        self._client = ControlClient(self._ctx, lambda: self._closed)
        progress_delay_us = number_option(cfg, "progress_delay_us", DEFAULT_PROGRESS_DELAY_US, int)
        self._agent = NixlAgent(list(backends), cfg.get("backend_params"), progress_delay_us)
        # One pool per connector serves both roles: send slabs and receive slabs.
        self._pool = RegisteredBufferPool(
            self._agent.register, self._agent.unregister, pool_bytes, what="NIXL"
        )
        close_at_exit(self)

    # -- sender -------------------------------------------------------------------------
    @classmethod
    def config_for_rank(cls, config: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """A fixed ``port`` P: TP rank r binds P + r (all ranks of a stage share one config)."""
        return offset_port(config, "port", rank)

    def receiver_metadata(self) -> dict[str, Any]:
        """The side channel's endpoint (bound now if it was not yet) and the agent's name:
        what every put's metadata holds, the same for every key."""
        return {"endpoint": self._ensure_server(), "agent": self._agent.name, "lease_s": self.lease_s}

    def put(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        """Pack ``payload`` into a registered slab and publish it under ``key``.

        The payload is copied once: the caller may reuse its tensors when this returns.
        Refusals (too big, key already published, no registered memory) return ``ok=False``.
        """
        self._check_open()
        self._check_key(key)
        return self._put_reserved(from_stage, to_stage, key, payload)

    def reserve(self, from_stage: Stage, to_stage: Stage, key: str, nbytes: int) -> Any:
        """A registered slab to write a packed payload of ``nbytes`` into; publishing holds
        it for receivers to READ (no further copy). Counts against ``max_held_bytes`` from
        now. See :class:`~vllm_kvbridge.connectors.base.Reservation`."""
        return self._reserve_slab(self._table, self._pool, key, nbytes, self._ensure_server)

    def _publish_lent(self, r: LentReservation, start: float) -> PutResult:
        """Publish the written slab of ``r`` under its key (see :meth:`reserve`)."""
        if (failed := self._publish_slab(self._table, r)) is not None:
            return failed
        endpoint = r.lent[1]
        self._control.key_put(r.key)  # receivers waiting for it get it now
        self.stats.add(puts=1, put_bytes=r.nbytes, put_seconds=time.perf_counter() - start)
        metadata = {"endpoint": endpoint, "agent": self._agent.name, "lease_s": self.lease_s}
        return PutResult(ok=True, nbytes=r.nbytes, metadata=metadata)

    def _release_lent(self, r: LentReservation) -> None:
        """An unpublished reservation ends: its slab and its reserved bytes go back."""
        self._release_slab(self._table, self._pool, r)

    def _ensure_server(self) -> str:
        with self._lock:
            if self._control is None:
                self._check_open()
                control = ControlServer(self._ctx, self.host, self.port, self.advertise_host, self._answer)
                # The tick looks for READ notifications (a finished reader's slab goes home)
                # and expires unclaimed payloads and leases.
                control.start(self._tick, _TICK_S)
                self._control = control
            return self._control.endpoint

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """The side channel's handler (server thread): ``request`` without the nonce."""
        verb = request[0]
        if verb == _GET and len(request) == 4 and len(request[2]) == 8 and len(request[3]) == 8:
            return self._answer_get(request[1], request[2], _u64(request[3]))
        if verb == _MD and len(request) == 1:
            metadata, gen, dgen = self._agent.metadata()
            return [_MD, self._agent.name.encode(), metadata, _U64.pack(gen), _U64.pack(dgen)]
        if verb == _NACK and len(request) == 2:
            self._release_read(request[1])
            return [_OK]
        if verb == RENEW and len(request) == 2:
            # A claimed key's own lease governs it. (Read already, but our notification not
            # seen yet: the reader itself answers False, see renew.)
            return [_OK if self._table.renew(request[1].decode("ascii", "replace")) else _MISSING]
        return [_BAD]

    def _answer_get(self, key_raw: bytes, receiver: bytes, limit: int) -> list[bytes]:
        # A key is claimed once; the same receiver asking again (its first answer came
        # after its deadline) gets the same claim, so nothing is lost between.
        held = self._table.claim(key_raw.decode("ascii", "replace"), receiver, limit)
        if held is None:
            return [_MISSING]
        if held.nbytes > limit:
            return [_TOOBIG, _U64.pack(held.nbytes)]
        agent = self._agent
        lease_ms = max(0, int((held.expires - time.monotonic()) * 1000))  # what is left of it
        fields = (held.value.ctypes.data, held.nbytes, agent.generation, agent.dereg_generation, lease_ms)
        return [_OK, agent.name.encode(), *(_U64.pack(v) for v in fields), held.claim]

    def _tick(self) -> None:
        if self._table.any_claimed:
            self._take_notifications()
        if time.monotonic() >= self._next_sweep:  # the server thread alone sweeps
            self._table.sweep()
            self._next_sweep = time.monotonic() + self._sweep_every

    def _take_notifications(self) -> None:
        for message in self._agent.notifications():
            if message.startswith(_TOKEN_PREFIX):
                self._release_read(message)

    def _release_read(self, token: bytes) -> None:
        """A reader is done with (or gave up) the slab it claimed with ``token``."""
        if (held := self._table.release_claim(token)) is not None:
            self._pool.release(held.value)

    def _expired_slab(self, held: Held[np.ndarray]) -> None:
        """The held table's sweep took ``held``: unread (ttl_s or renewal lease), or a claim
        whose reader died or gave up (a reader never reads past its lease). Such a slab is
        never reused: unregistered, a late READ fails on RDMA instead of reading another payload."""
        (self._pool.discard if held.claimed else self._pool.release)(held.value)

    # -- receiver -----------------------------------------------------------------------
    def get(
        self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None, *, deadline: Due = None
    ) -> Any | None:
        """Claim ``key`` at the sender in ``metadata``, READ it and decode it in place.

        With a deadline, "not there yet" answers are retried (1 ms backoff up to 20 ms)
        until it passes, then :class:`TransferTimeout` (also when the sender never answers).
        Without one, a single request: ``None`` if missing. Once claimed, the READ is bounded
        by ``transfer_timeout_s`` and the sender's lease, not by the deadline.
        """
        self._check_open()
        self._check_key(key)
        endpoint = (metadata or {}).get("endpoint") or self.config.get("endpoint")
        if not endpoint:
            raise TransferError(
                f"cannot get {key!r}: no endpoint in the put metadata (metadata={metadata!r}) "
                f"and no 'endpoint' in the {self.name} config"
            )
        start = time.perf_counter()
        try:
            result = self._pull(str(endpoint), key, deadline)
        except TransferTimeout:
            self.stats.add(timeouts=1)
            raise
        except TransferError:
            self.stats.add(get_failures=1)
            raise
        if result is None:
            self.stats.add(get_misses=1)
            return None
        payload, nbytes = result
        self.stats.add(gets=1, get_bytes=nbytes, get_seconds=time.perf_counter() - start)
        return payload

    def renew(self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None) -> bool:
        """RENEW ``key`` at the sender in ``metadata`` (see the module docstring): True while it
        holds the key, False once not; :class:`TransferError` past ``request_timeout_s``."""
        self._check_open()
        self._check_key(key)
        endpoint = (metadata or {}).get("endpoint") or self.config.get("endpoint")
        if not endpoint:
            raise TransferError(f"cannot renew {key!r}: no endpoint in the put metadata or the config")
        if self._was_consumed((str(endpoint), key)):
            return False  # we read it; the sender has not seen our notification yet
        return self._client.renew(str(endpoint), key, self.request_timeout_s)

    def _pull(self, endpoint: str, key: str, deadline: float | None) -> tuple[Any, int] | None:
        # TransferError at once when the sender is gone (its port refuses connections),
        # TransferTimeout when it does not answer in time. With a deadline the sender
        # holds each request until the key is put (te_control's long poll).
        request = [_GET, key.encode("ascii"), self._receiver_id, _U64.pack(self.max_payload_bytes)]
        answer = self._client.claim(
            endpoint,
            key,
            request,
            deadline,
            fields=7,
            request_timeout_s=self.request_timeout_s,
            max_payload_bytes=self.max_payload_bytes,
            check_open=self._check_open,
            # Ours already (read to the end): the sender has not seen our notification yet.
            taken=lambda answer: self._was_consumed(answer[7]),
        )
        return None if answer is None else self._read_claimed(endpoint, key, answer)

    def _read_claimed(self, endpoint: str, key: str, fields: list[bytes]) -> tuple[Any, int]:
        from vllm_kvbridge.wire import decode_packed

        claimed = time.monotonic()
        peer = fields[0].decode("ascii", "replace")
        addr, nbytes, gen, dgen, lease_ms = (_u64(f) for f in fields[1:6])
        token = fields[6]
        try:
            if nbytes > self.max_payload_bytes:
                raise TransferRefused(f"{key!r} at {endpoint} is {nbytes} bytes, over max_payload_bytes")
            self._ensure_peer(endpoint, peer, gen, dgen, claimed + self.request_timeout_s)
            slab, _ = self._pool.acquire(nbytes)
        except BaseException:
            self._nack(endpoint, token)
            raise
        # Never read past the sender's lease: after it the sender may reuse its slab.
        budget = min(self.transfer_timeout_s, lease_ms / 1000 * _LEASE_SHARE) - (time.monotonic() - claimed)
        try:
            if budget <= 0:
                raise TransferTimeout(f"the lease on {key!r} at {endpoint} ended before the READ could start")
            self._agent.read(peer, addr, slab.ctypes.data, nbytes, token, budget)
        except BaseException:
            # The transport may still write into the slab: never hand it out again.
            self._pool.discard(slab)
            with self._lock:
                self._quarantine.append(slab)
            self._nack(endpoint, token)
            raise
        with self._lock:
            self._consumed[token] = self._consumed[(endpoint, key)] = None
            while len(self._consumed) > 2 * _MAX_CONSUMED:
                self._consumed.popitem(last=False)
        view = self._pool.lend_view(slab, nbytes)  # slab goes home when the last tensor dies
        try:
            return decode_packed(view, limits=self._limits, copy=False), nbytes
        except PayloadError as exc:
            raise TransferCorrupt(f"payload {key!r} from {endpoint} does not decode: {exc}") from exc
        finally:
            del view

    def _was_consumed(self, token: bytes | tuple[str, str]) -> bool:
        with self._lock:
            return token in self._consumed

    def _ensure_peer(self, endpoint: str, peer: str, gen: int, dgen: int, until: float) -> None:
        """Load the peer's agent metadata when ours predates the registration the READ needs."""
        have = self._agent.peer_generation(peer)
        if have is not None and have[0] >= gen and have[1] == dgen:
            return
        answer = self._client.request(endpoint, [_MD], until)
        if len(answer) != 5 or answer[0] != _MD:
            raise TransferError(
                f"the NIXL sender at {endpoint} answered {answer[:1]!r} to a metadata request"
            )
        name = answer[1].decode("ascii", "replace")
        if name != peer:
            raise TransferError(f"{endpoint} is agent {name!r} now, not {peer!r} (sender restarted?)")
        try:
            self._agent.load_peer(peer, answer[2], _u64(answer[3]), _u64(answer[4]))
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"cannot load the NIXL metadata of {peer!r} from {endpoint}: {exc}") from exc

    def _nack(self, endpoint: str, token: bytes) -> None:
        """Tell the sender a claimed READ failed, so it releases the slab now (best effort)."""
        try:
            self._client.request(endpoint, [_NACK, token], time.monotonic() + _NACK_WAIT_S)
        except TransferError:
            pass  # the sender is gone or busy: its lease releases the slab

    # -- lifecycle ----------------------------------------------------------------------
    def cleanup(self, key: str) -> None:
        """Release ``key`` if it is still published here (a claimed one waits for its reader). Idempotent."""
        self._check_key(key)
        if (held := self._table.drop(key)) is not None:
            self._pool.release(held.value)
            self.stats.add(cleanups=1)

    def health(self) -> dict[str, Any]:
        held = self._table.counts()
        extra: dict[str, Any] = {
            "endpoint": self.endpoint,
            "published": held["held"],
            "lent": held["claimed"],
            "held_payloads": held["held"] + held["claimed"],
            "held_bytes": held["held_bytes"],
            "expired": held["expired"],
        }
        agent = self._agent
        regions, nbytes = agent.registered if agent is not None else (0, 0)
        extra.update(
            agent=agent.name if agent is not None else None,
            peer_loads=agent.peer_loads if agent is not None else 0,
            peer_invalidations=agent.peer_invalidations if agent is not None else 0,
            registered_regions=regions,
            registered_bytes=nbytes,
            buffer_registrations=self._pool.registrations if self._pool is not None else 0,
            ucx_env=self.ucx_env,
        )
        return {**super().health(), **extra}

    def _close(self) -> None:
        closed_normally(self)
        if self._control is not None:
            self._control.close()  # joins the server thread: no handler runs after this
        self._table.clear()
        with self._lock:
            self._quarantine.clear()
        if self._client is not None:
            self._client.close()
        if self._pool is not None:
            self._pool.close()  # deregisters every slab, free or lent
        if self._agent is not None:
            self._agent.close()
        # term() waits until sockets busy in other threads' gets are closed.
        self._ctx.term()


__all__ = ["NixlConnector"]
