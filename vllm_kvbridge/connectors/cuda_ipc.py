"""Same-host GPU to GPU transport through CUDA IPC: the payload never touches host memory.

The sender packs a payload (the codec's packed layout, :mod:`vllm_kvbridge.wire.device_pack`)
into a device buffer it lends from a bounded budget (``pool_bytes``); the KV sender's
gather writes straight into it from vLLM's paged cache (:meth:`CudaIpcConnector.reserve`
lends the device buffer, so no host staging is involved). Publishing shares the buffer
through torch's own CUDA IPC machinery (``UntypedStorage._share_cuda_``: a
``cudaIpcMemHandle`` plus torch's cross-process reference count) and puts a small control
message (the handle, the packed head) on an inner :class:`SharedMemoryConnector` under the
payload's key. The receiver gets the control message, opens the handle, copies the bytes
device to device onto its own device (``device``; peer to peer where the GPUs differ),
acknowledges (a control message back), and decodes the copy: tensors are views of it.

Lifetime of a lent buffer (the budget's bytes come back when):

* the receiver's acknowledgement arrives (the normal case; looked for at every reserve,
  put and ``health``), or
* its control message expired unread: ``ttl_s`` after the put, or a lease after a
  receiver's last renewal (:meth:`CudaIpcConnector.renew` renews the control message;
  counted in ``expired``), or
* ``claim_grace_s`` after its message was read without an acknowledgement (a receiver
  that died between its read and its copy).

Dropping the sender's reference is always safe for a receiver that opened the handle:
torch keeps the memory of a shared block out of reuse until every opener released it.

Ordering: the bytes are written on the filling thread's current stream; the reservation
records an event there and the publish (on the I/O thread) waits for it before the handle
is shared, so a receiver never sees a buffer still being written. The receiver therefore
skips the interprocess event torch shares with the handle (``event_sync_required``): torch
records it on the sender's I/O thread's current stream, the legacy default stream, so
waiting on it would wait for whatever the sending engine had queued there. The receiver
copies on a side stream of its own (one per device, not the caller's stream: a prefetch
never waits for the denoising queued on the current stream, nor the denoising for it),
records a blocking-sync event after the copy and waits on that event alone (the thread
sleeps instead of spinning) before it acknowledges; it never synchronizes a device or a
whole stream. The copy's destination is allocated on the side stream and marked used by
the caller's current stream (``record_stream``), so the allocator never hands the block to
the next copy while kernels of the caller's stream still read it.

Two GPUs (the design): a handle opens only on the GPU its memory is on, so the receiver's
process must see the sender's GPU. A receiving stage sees its own GPU(s) first (its
``cuda:0`` stays its own) and the sender's after them: the resolver computes that from
both stages' ``devices`` (:func:`~vllm_kvbridge.config.gpu_pairing.cuda_ipc_visible_devices`)
and refuses, naming the fix, stages it cannot pair, when the config is resolved rather than
at every request. The control message names the sender's GPU by UUID (indices differ
between processes with different ``CUDA_VISIBLE_DEVICES``); the receiver opens the handle
there and copies peer to peer into its own device. Opening it gives the receiver's process
a CUDA context on the sender's GPU (a few hundred MiB there, outside the sending engine's
``gpu_memory_utilization``). That cost is not hidden: it is logged (a warning, once per
GPU and process) and ``health()["peer_gpus"]`` lists those GPUs; the stage configs say to
leave room for it beside ``pool_bytes``. The alternative, the sender writing into a buffer
lent by the receiver, would put a context of the vLLM process on the receiver's GPU and
need the receiver's buffer before the KV is gathered, so it was not taken. Where the
receiver still cannot see the sender's GPU (a stage started outside the resolver) each
receive is refused (:class:`TransferRefused`) with the same fix in its message.

Needs CUDA in both processes and one host: a connector made where
``torch.cuda.is_available()`` is false refuses at once (:class:`ConfigError`, at the
stage's start), naming the connector to use instead.

Memory: the lent buffers are the sender's device memory outside vLLM's budget, so a
sending engine's ``gpu_memory_utilization`` must leave ``pool_bytes`` free (a reserve the
allocator cannot serve answers ``full`` and is retried, never fails the request at once).

Config keys (all optional): ``device`` (default: this process's current CUDA device),
``pool_bytes`` (default 4 GiB: device bytes lent at once; a reserve over it answers
``full``), ``max_payload_bytes`` (default ``pool_bytes``), and for the control messages,
as :class:`SharedMemoryConnector` takes them: ``ttl_s`` (default 300), ``lease_s``,
``claim_grace_s`` (default 30), ``reap_interval_s``, ``namespace``, ``shm_dir``.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvbridge.connectors.base import (
    Connector,
    Due,
    Meta,
    PutResult,
    Reservation,
    Stage,
    number_option,
    parse_size,
)
from vllm_kvbridge.connectors.cuda_ipc_devices import local_gpu_index
from vllm_kvbridge.connectors.shm import SharedMemoryConnector
from vllm_kvbridge.errors import ConfigError, TransferCorrupt, TransferRefused
from vllm_kvbridge.wire.fill import TensorFill

logger = logging.getLogger(__name__)

__all__ = ["CudaIpcConnector", "DeviceReservation"]

#: Config keys the control messages' shared-memory connector takes from ours.
_CONTROL_KEYS = ("namespace", "shm_dir", "ttl_s", "lease_s", "claim_grace_s", "reap_interval_s")
#: Control message format version.
VERSION = 1
#: Fields of ``UntypedStorage._share_cuda_()``'s tuple, in order (torch 2.x).
_HANDLE_FIELDS = 8


#: This process's lent buffers by token: a receiver in the sender's own process (CUDA
#: cannot open an IPC handle where it was made) reads the buffer itself.
_OWN_BUFFERS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
#: This process, unlike a pid also across PID namespaces.
_PROCESS = uuid.uuid4().hex


def _ack_key(key: str) -> str:
    return f"{key}.ack"


@dataclass
class _Lent:
    """A published device buffer, until the receiver is done with it."""

    buffer: torch.Tensor
    nbytes: int
    from_stage: Stage
    to_stage: Stage
    claimed_at: float = 0.0  # monotonic, when this side saw its control message was read


class DeviceReservation(Reservation):
    """A device buffer of ``nbytes`` lent by a :class:`CudaIpcConnector`. ``buffer`` is a
    contiguous 1-D uint8 CUDA tensor (not a memoryview: writers use
    :func:`~vllm_kvbridge.wire.device_pack.pack_into_device`), and the writer calls
    :meth:`filled` with the head it returned, on the stream that wrote, before publishing."""

    def __init__(self, owner: CudaIpcConnector, from_stage: Stage, to_stage: Stage, key: str, nbytes: int):
        super().__init__(key, nbytes, torch.empty(max(nbytes, 1), dtype=torch.uint8, device=owner.device))  # type: ignore[arg-type]
        self._owner, self._stages = owner, (from_stage, to_stage)
        self._head: bytes | None = None
        self._event: torch.cuda.Event | None = None
        self._done = False

    def filled(self, head: bytes) -> None:
        """The packed bytes are enqueued on the current stream; ``head`` is their head."""
        self._head = head
        # Blocking sync: the publishing thread sleeps until the bytes are written (a
        # default event's synchronize spins on a core the engine needs).
        self._event = torch.cuda.Event(blocking=True)
        self._event.record(torch.cuda.current_stream(self.buffer.device))

    def publish(self, *, since: float | None = None) -> PutResult:
        if self._done:
            return PutResult(ok=False, error=f"reservation of {self.key!r} was published or released")
        if self._head is None or self._event is None:
            return PutResult(
                ok=False, error=f"reservation of {self.key!r} was published before it was filled"
            )
        self._event.synchronize()  # the writer's stream finished the bytes
        result = self._owner._publish(self, self._head, since)
        if result.ok:
            self._done = True
        return result

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._owner._unreserve(self.nbytes)


class CudaIpcConnector(Connector):
    name = "CudaIpcConnector"
    #: The buffer dies with the sender's process (its CUDA context).
    data_outlives_sender = False
    #: :meth:`reserve` lends device memory: a KV sender packs into it on the device (no
    #: host staging pool; see ``kv/send.py``).
    device_resident = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        if not torch.cuda.is_available():
            raise ConfigError(
                "CudaIpcConnector moves device memory between GPU processes of one host, and this process "
                "has no CUDA device (torch.cuda.is_available() is False); use SharedMemoryConnector here"
            )
        cfg = self.config
        device = cfg.get("device")
        self.device = (
            torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
        if self.device.type != "cuda":
            raise ConfigError(f"CudaIpcConnector: device must be a CUDA device, got {self.device}")
        if self.device.index is None:  # "cuda": this process's current one, by index (streams)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pool_bytes = parse_size(cfg.get("pool_bytes", 4 << 30), "pool_bytes")
        self.max_payload_bytes = number_option(cfg, "max_payload_bytes", self.pool_bytes, int)
        self.claim_grace_s = number_option(cfg, "claim_grace_s", 30.0)
        # The control messages carry the TTL and leases: a buffer lives as long as its
        # message is published (renewals included), then until its receiver acknowledges.
        self._control = SharedMemoryConnector({k: cfg[k] for k in _CONTROL_KEYS if k in cfg})
        self._unread: collections.deque[str] = collections.deque()  # keys the control reaped unread
        self._control.on_expired = self._unread.append
        self._lock = threading.Lock()
        self._lent: dict[str, _Lent] = {}
        self._reserved = 0  # bytes of reservations not yet published
        self._streams: dict[int, torch.cuda.Stream] = {}  # the receiver's copy stream per device

    # -- sender ---------------------------------------------------------------------------
    def reserve(self, from_stage: Stage, to_stage: Stage, key: str, nbytes: int) -> Any:
        self._check_open()
        self._check_key(key)
        if (refused := self._refuse_oversize(nbytes)) is not None:
            return refused
        with self._lock:
            if key in self._lent:  # before any device memory is spent on it
                return self._put_failed(f"key {key!r} is already published")
            self._sweep_locked()
            held = self._held_locked()
            if held + nbytes > self.pool_bytes:
                return self._put_full(
                    f"{held} device bytes lent + {nbytes} exceeds pool_bytes={self.pool_bytes}"
                )
            self._reserved += nbytes
        try:
            return DeviceReservation(self, from_stage, to_stage, key, nbytes)
        except torch.cuda.OutOfMemoryError as exc:
            self._unreserve(nbytes)
            return self._put_full(f"no device memory for {nbytes} bytes now: {exc}")

    def put(self, from_stage: Stage, to_stage: Stage, key: str, payload: Any) -> PutResult:
        from vllm_kvbridge.wire import encode
        from vllm_kvbridge.wire.device_pack import pack_into_device

        self._check_open()
        start = time.perf_counter()
        enc = encode(_device_fills(payload))
        reservation = self.reserve(from_stage, to_stage, key, enc.packed_size())
        if isinstance(reservation, PutResult):
            return reservation
        try:
            reservation.filled(pack_into_device(enc, reservation.buffer))
            return reservation.publish(since=start)
        finally:
            reservation.release()  # a no-op once published

    def _publish(self, reservation: DeviceReservation, head: bytes, since: float | None) -> PutResult:
        from_stage, to_stage = reservation._stages
        buffer = reservation.buffer
        storage = buffer.untyped_storage()
        handle = list(storage._share_cuda_())  # type: ignore[attr-defined]
        message = {
            "v": VERSION,
            # CUDA_VISIBLE_DEVICES may number the GPU differently in the receiver
            "gpu": str(torch.cuda.get_device_properties(buffer.device).uuid),
            "handle": handle,
            "offset": buffer.storage_offset(),
            "nbytes": reservation.nbytes,
            "head": head,
            "process": _PROCESS,
            "token": uuid.uuid4().hex,
        }
        _OWN_BUFFERS[message["token"]] = buffer
        result = self._control.put(from_stage, to_stage, reservation.key, message)
        if not result.ok:  # still a reservation: the caller may publish again or release
            return self._put_full(result.error or "") if result.full else self._put_failed(result.error or "")
        # Lent only now, so a sweep never takes a message not yet published for a read one
        # (an acknowledgement that came first waits for the next sweep).
        with self._lock:
            self._lent[reservation.key] = _Lent(buffer, reservation.nbytes, from_stage, to_stage)
            self._reserved -= reservation.nbytes
        seconds = time.perf_counter() - since if since is not None else 0.0
        self.stats.add(puts=1, put_bytes=reservation.nbytes, put_seconds=seconds)
        return PutResult(ok=True, nbytes=reservation.nbytes, metadata=dict(result.metadata))

    def _unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def _held_locked(self) -> int:
        return self._reserved + sum(e.nbytes for e in self._lent.values())

    def _sweep_locked(self) -> None:
        """Take back buffers whose receiver acknowledged, whose control message expired
        unread, or that were read and never acknowledged for ``claim_grace_s``."""
        while self._unread:
            self._lent.pop(self._unread.popleft(), None)  # nobody can open it any more
        now = time.monotonic()
        for key, entry in list(self._lent.items()):
            if self._control.get(entry.to_stage, entry.from_stage, _ack_key(key)) is not None:
                del self._lent[key]
            elif entry.claimed_at == 0.0:
                if not self._control.publishes(key):
                    entry.claimed_at = now
            elif now - entry.claimed_at >= self.claim_grace_s:  # its receiver died reading
                del self._lent[key]

    def cleanup(self, key: str) -> None:
        self._check_key(key)
        with self._lock:
            if key in self._lent and self._control.withdraw(key):
                del self._lent[key]

    # -- receiver -------------------------------------------------------------------------
    def get(
        self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None, *, deadline: Due = None
    ) -> Any | None:
        """Open the sender's buffer, copy it device to device onto :attr:`device`,
        acknowledge, and decode the copy (tensors are views of it, on :attr:`device`)."""
        from vllm_kvbridge.wire.decode import decode_packed_device

        self._check_open()
        start = time.perf_counter()
        message = self._control.get(from_stage, to_stage, key, metadata, deadline=deadline)
        if message is None:
            return None
        handle, offset, nbytes, head = _parse_message(key, message)
        consumer = torch.cuda.current_stream(self.device)  # where the caller will use the tensors
        try:
            data = self._copy_in(key, message, handle, offset, nbytes, consumer)  # done before the ack
        except RuntimeError as exc:
            self.stats.add(get_failures=1)
            raise TransferCorrupt(f"{key}: cannot open the sender's CUDA IPC buffer: {exc}") from exc
        finally:
            ack = self._control.put(to_stage, from_stage, _ack_key(key), {"pid": os.getpid()})
            if not ack.ok:  # the sender takes the buffer back after its TTL and grace
                logger.warning("CudaIpcConnector %s: acknowledgement not sent: %s", key, ack.error)
        # On the side stream too: checking bool bytes and copying arrays to the host wait for
        # that stream only, not for the kernels queued on the caller's.
        with torch.cuda.stream(self._side_stream(self.device)):
            payload = decode_packed_device(head, data[:nbytes])
        self.stats.add(gets=1, get_bytes=nbytes, get_seconds=time.perf_counter() - start)
        return payload

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """This connector's copy stream on ``device`` (a pool stream: it does not wait for
        the legacy default stream, nor that stream for it)."""
        index = torch.device(device).index
        assert index is not None
        with self._lock:
            stream = self._streams.get(index)
            if stream is None:
                stream = self._streams[index] = torch.cuda.Stream(device=index)
            return stream

    def _copy_in(
        self,
        key: str,
        message: Mapping[str, Any],
        handle: list[Any],
        offset: int,
        nbytes: int,
        consumer: torch.cuda.Stream,
    ) -> torch.Tensor:
        """The sender's buffer copied into a new buffer on :attr:`device`, complete when
        this returns.

        Only the copy is waited for: it runs on side streams (torch runs a copy between two
        devices on the source device's current stream, after the destination device's
        current stream, so both are ours), and this thread sleeps on a blocking event
        recorded after it."""
        src_device = _source_device(key, message)
        dst_stream = self._side_stream(self.device)
        src_stream = self._side_stream(src_device)  # the same one where the GPUs are
        with torch.cuda.stream(src_stream), torch.cuda.stream(dst_stream):
            src = _open(key, message, handle, offset, nbytes, src_device, self.device)
            try:
                # Allocated on the copy's stream: a block the caching allocator took back
                # from the caller's stream may still be read by kernels queued there.
                data = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
                data[:nbytes].copy_(src)
                done = torch.cuda.Event(blocking=True)
                done.record(dst_stream)
                done.synchronize()
            finally:
                # Dropped here: torch's release of an opened IPC buffer synchronizes the
                # current stream of its device, which must be ours (done), not the caller's.
                del src
        # The tensors decoded from it are used on the caller's stream: the block goes back
        # to the allocator only once that stream is past its last use.
        data.record_stream(consumer)
        return data

    # -- lifecycle ------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        with self._lock:
            if not self._closed:
                self._sweep_locked()
            pool: dict[str, Any] = {
                "device": str(self.device),
                "pool_bytes": self.pool_bytes,
                "lent": len(self._lent),
                "held_bytes": self._held_locked(),
            }
        with _PEERS_LOCK:
            pool["peer_gpus"] = sorted(_PEER_CONTEXTS.values())  # contexts on senders' GPUs
        control = self._control.health()
        return {**super().health(), **pool, "expired": control["expired"]}

    def _close(self) -> None:
        with self._lock:
            self._lent.clear()  # receivers that opened a buffer keep it (torch's IPC count)
        self._control.close()

    def receiver_metadata(self) -> dict[str, Any]:
        return self._control.receiver_metadata()

    def renew(self, from_stage: Stage, to_stage: Stage, key: str, metadata: Meta = None) -> bool:
        """Receiver side: keep ``key``'s control message (and so its buffer) for a lease."""
        self._check_open()
        return self._control.renew(from_stage, to_stage, key, metadata)

    @classmethod
    def reap_dead(cls, config: Mapping[str, Any], from_stage: Stage, to_stage: Stage) -> list[str]:
        control = {k: config[k] for k in ("namespace", "shm_dir") if k in config}
        forward = SharedMemoryConnector.reap_dead(control, from_stage, to_stage)
        return forward + SharedMemoryConnector.reap_dead(control, to_stage, from_stage)  # acknowledgements


def _own_buffer(key: str, message: Mapping[str, Any]) -> torch.Tensor | None:
    """The buffer of a message this process published (None: another process's)."""
    if message.get("process") != _PROCESS:
        return None
    buffer = _OWN_BUFFERS.get(str(message.get("token")))
    if buffer is None:
        raise TransferRefused(f"{key}: this process's buffer was already taken back")
    return buffer


def _source_device(key: str, message: Mapping[str, Any]) -> torch.device:
    """The device, as this process numbers them, of the buffer ``message`` names."""
    own = _own_buffer(key, message)
    if own is not None:
        return own.device
    return torch.device("cuda", local_gpu_index(key, message.get("gpu"), _visible_uuids()))


def _open(
    key: str,
    message: Mapping[str, Any],
    handle: list[Any],
    offset: int,
    nbytes: int,
    device: torch.device,
    receiver: torch.device,
) -> torch.Tensor:
    """The sender's buffer as a uint8 tensor of ``nbytes`` on ``device``
    (:func:`_source_device`): opened through its IPC handle, or looked up where the sender
    is this process. ``receiver``: the receiving connector's device."""
    own = _own_buffer(key, message)
    if own is not None:
        return own[:nbytes]
    # The sender waited for its bytes before it shared the handle (DeviceReservation.publish);
    # torch's event would also make the copy wait for the sender's unrelated work.
    index = device.index
    assert index is not None  # _source_device names it by index
    handle[0], handle[_HANDLE_FIELDS - 1] = index, False
    if device != receiver:
        _note_peer_context(index, str(message.get("gpu")), receiver)
    storage = torch.UntypedStorage._new_shared_cuda(*handle)  # type: ignore[attr-defined]
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, offset, (nbytes,))


def _device_fills(payload: Any) -> Any:
    """``payload`` with each dense CUDA tensor as a fill that copies it where it is packed:
    device to device into the lent buffer (the codec would otherwise copy it to the host
    when encoding). Containers are rebuilt; anything else is passed as it is."""
    if isinstance(payload, torch.Tensor):
        if payload.is_cuda and payload.is_contiguous() and payload.layout == torch.strided:
            src = payload.detach()
            return TensorFill(tuple(src.shape), src.dtype, lambda out: out.copy_(src), src.device)
        return payload
    if isinstance(payload, dict):
        return {k: _device_fills(v) for k, v in payload.items()}
    if isinstance(payload, list | tuple):
        items = [_device_fills(v) for v in payload]
        return tuple(items) if isinstance(payload, tuple) else items
    return payload


#: This process's GPU UUIDs in index order (fixed for the process's life).
_VISIBLE_UUIDS: list[str] = []
#: Device index -> UUID of the senders' GPUs this process opened a CUDA context on.
_PEER_CONTEXTS: dict[int, str] = {}
_PEERS_LOCK = threading.Lock()


def _visible_uuids() -> list[str]:
    if not _VISIBLE_UUIDS:
        found = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
        _VISIBLE_UUIDS[:] = found
    return _VISIBLE_UUIDS


def _note_peer_context(index: int, gpu: str, own: torch.device) -> None:
    """Say, once per GPU, that this process opens a CUDA context on a sender's GPU: its
    memory is taken there, beside the sending engine's budget, not on this stage's GPU."""
    with _PEERS_LOCK:
        if index in _PEER_CONTEXTS:
            return
        _PEER_CONTEXTS[index] = gpu
    logger.warning(
        "CudaIpcConnector: receiving on %s, this process opens a CUDA context on the sender's GPU %s "
        "(cuda:%d here) to map its buffers; that context (a few hundred MiB) is taken on the sender's "
        "GPU, outside its engine's gpu_memory_utilization: leave room for it there beside pool_bytes",
        own,
        gpu,
        index,
    )


def _parse_message(key: str, message: Any) -> tuple[list[Any], int, int, bytes]:
    """``(handle, storage offset, nbytes, head)`` of a control message, checked."""
    try:
        if message["v"] != VERSION:
            raise ValueError(f"version {message['v']!r}, this build reads {VERSION}")
        handle, offset, nbytes, head = (
            message["handle"],
            message["offset"],
            message["nbytes"],
            message["head"],
        )
        if not (isinstance(handle, list) and len(handle) == _HANDLE_FIELDS):
            raise ValueError("malformed handle")
        if not (isinstance(offset, int) and isinstance(nbytes, int) and offset >= 0 and nbytes >= 0):
            raise ValueError("malformed offset or size")
        if not isinstance(head, bytes):
            raise ValueError("malformed head")
    except (KeyError, TypeError, ValueError) as exc:
        raise TransferCorrupt(f"{key}: not a CUDA IPC control message: {exc}") from None
    return handle, offset, nbytes, head
