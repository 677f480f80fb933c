"""Stage payload flows without vLLM: build, send, receive, reassemble, fan out.

Usable on its own (a pipeline stage process, the diffusion runner) and composed by the
runner mixins (:mod:`vllm_kvbridge.runner.payload_transport`).

Wire form
---------
Every object put on a connector by these flows is an *envelope*::

    {"kvbridge": {"v": 1, "kind": "full" | "chunk" | "abort", "rid": <transfer id>,
                  "chunk": <index or None>, "final": bool, "error": <str or None>},
     "data": <payload dict or None>}

under :func:`~vllm_kvbridge.connectors.keys.payload_key` (``chunk=None`` for a full
payload, ``chunk=i`` for async chunk ``i``). An async stream is chunks ``0, 1, ...`` and
ends with one whose ``final`` is true (it may carry data or none). An ``abort`` envelope
takes the place of the next chunk (or of the full payload) when the sender cancels the
request or its send failed; the receiver fails the request with the sender's reason.

Merging (the same rule on the sender's per-step accumulator and on the receiver's chunk
concatenation, :func:`merge_payloads`): tensors are concatenated on dim 0, lists are
extended, and keys named in ``replace_keys`` (and any other value) take the latest value.

Ordering contract (sender and receiver alike)
---------------------------------------------
* One lock per object (``self._lock``) guards its per-request state; connector I/O is never
  done while holding it, so ``cancel``/``result``/``status`` never wait on the network.
* Sender: jobs wait in one FIFO queue; each request with queued jobs has one *lane*, a
  task of the sender's :class:`~vllm_kvbridge.connectors.put_retry.PutScheduler` that puts
  the request's jobs one at a time in the order they were submitted (chunk ``i`` lands
  before chunk ``i+1``). A lane that waits - for room on a full edge, for a retry's
  backoff - holds none of the I/O threads, so every request's put is tried and fails on
  its own, ``send_timeout_s`` after it could start (its enqueue, or its request's
  previous put), never after the puts of other requests (issue 36: four threads that each
  waited out a full edge made the fifth request wait twice as long); a put that is slow
  in the connector itself (a slow link) holds one thread and leaves the others to the
  rest of the edge. ``abort`` removes the request's queued puts and enqueues the abort
  envelope after the put in progress.
* Receiver: only the receive thread appends chunks, in chunk-id order; a request's terminal
  state (done, failed, cancelled) is set once, under the lock, and nothing is appended
  after it. Waiters are woken through one condition variable on that lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.connectors.keys import payload_key
from vllm_kvbridge.connectors.put_retry import PutAttempt, PutOutcome, PutScheduler
from vllm_kvbridge.errors import (
    ConfigError,
    TransferCorrupt,
    TransferError,
)
from vllm_kvbridge.runner.doorbell import BELL_KEY, Bell
from vllm_kvbridge.runner.transfer_status import is_failed

logger = logging.getLogger(__name__)

#: I/O threads per payload sender (per edge): enough that a few puts slow in the connector
#: (a slow link) do not hold up the rest of the edge; waits for room hold none of them; a
#: request's own puts still run one at a time.
SEND_WORKERS = 4

ENVELOPE_KEY = "kvbridge"
ENVELOPE_VERSION = 1
FULL, CHUNK, ABORT = "full", "chunk", "abort"


class PayloadAborted(TransferError):
    """The sender cancelled the request or could not send it (message has its reason)."""


# -- merging ----------------------------------------------------------------------------------


def merge_payloads(parts: Iterable[Mapping[str, Any]], replace_keys: Iterable[str] = ()) -> dict[str, Any]:
    """Merge payload dicts in order (tensors cat on dim 0, lists extended, else replaced)."""
    replace = set(replace_keys)
    tensors: dict[str, list[torch.Tensor]] = {}
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if key not in replace and isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors.setdefault(key, []).append(value)
                out[key] = None  # keeps first-seen key order
            elif key not in replace and isinstance(value, list) and isinstance(out.get(key), list):
                out[key] = out[key] + value
            else:
                tensors.pop(key, None)
                out[key] = list(value) if isinstance(value, list) else value
    for key, items in tensors.items():
        out[key] = items[0] if len(items) == 1 else torch.cat(items, dim=0)
    return out


class PayloadAccumulator:
    """Collects a request's per-step outputs until they are taken as one payload/chunk."""

    def __init__(self, replace_keys: Iterable[str] = ()) -> None:
        self.replace_keys = tuple(replace_keys)
        self._parts: list[dict[str, Any]] = []
        self.steps = 0  # steps added since the last take()
        self.tokens = 0  # tokens those steps generated

    def add(self, step_output: Mapping[str, Any], tokens: int = 1) -> None:
        self._parts.append(dict(step_output))
        self.steps += 1
        self.tokens += tokens

    def __bool__(self) -> bool:
        return bool(self._parts)

    def take(self) -> dict[str, Any]:
        parts, self._parts, self.steps, self.tokens = self._parts, [], 0, 0
        return merge_payloads(parts, self.replace_keys)


# -- envelopes ---------------------------------------------------------------------------------


def make_envelope(
    kind: str,
    request_id: str,
    data: Mapping[str, Any] | None,
    *,
    chunk: int | None = None,
    final: bool = True,
    error: str | None = None,
) -> dict[str, Any]:
    head = {
        "v": ENVELOPE_VERSION,
        "kind": kind,
        "rid": request_id,
        "chunk": chunk,
        "final": final,
        "error": error,
    }
    return {ENVELOPE_KEY: head, "data": None if data is None else dict(data)}


def open_envelope(
    obj: Any, request_id: str, chunk: int | None
) -> tuple[str, bool, dict[str, Any] | None, str | None]:
    """Validate an envelope; return ``(kind, final, data, error)`` or raise TransferCorrupt."""
    where = f"payload of request {request_id!r}" + (f" chunk {chunk}" if chunk is not None else "")
    if not isinstance(obj, Mapping) or not isinstance(obj.get(ENVELOPE_KEY), Mapping):
        raise TransferCorrupt(f"{where}: not a kvbridge payload envelope (got {type(obj).__name__})")
    head = obj[ENVELOPE_KEY]
    if head.get("v") != ENVELOPE_VERSION:
        raise TransferCorrupt(f"{where}: envelope version {head.get('v')!r}, expected {ENVELOPE_VERSION}")
    if head.get("rid") != request_id:
        raise TransferCorrupt(f"{where}: envelope is for request {head.get('rid')!r}")
    kind = head.get("kind")
    if kind not in (FULL, CHUNK, ABORT):
        raise TransferCorrupt(f"{where}: unknown envelope kind {kind!r}")
    if kind != ABORT and head.get("chunk") != chunk:
        raise TransferCorrupt(f"{where}: envelope carries chunk {head.get('chunk')!r}")
    data = obj.get("data")
    if data is not None and not isinstance(data, Mapping):
        raise TransferCorrupt(f"{where}: data must be a dict, got {type(data).__name__}")
    return kind, bool(head.get("final")), (dict(data) if data is not None else None), head.get("error")


# -- sender ------------------------------------------------------------------------------------


@dataclass
class _PutJob:
    request_id: str
    key: str
    envelope: dict[str, Any]
    queued_at: float = field(default_factory=time.monotonic)


class _Lane:
    """The puts of one request, one at a time in submission order: a scheduler task that
    takes the request's next queued job when its put is over, and ends with the queue."""

    def __init__(self, sender: PayloadSender, request_id: str) -> None:
        self._sender, self._request_id = sender, request_id
        self._job: _PutJob | None = None
        self._attempt: PutAttempt | None = None
        self._free_since = time.monotonic()  # when the request's previous put ended

    def __call__(self) -> float | None:
        sender = self._sender
        if self._job is None:
            self._job = sender._next_job(self._request_id)
            if self._job is None:
                return None  # nothing queued: the lane is over (sender._next_job ended it)
            # Its send_timeout runs from when it could start: its own enqueue, or when the
            # request's previous put ended (a chunk waits for the one before it).
            deadline = max(self._job.queued_at, self._free_since) + sender.send_timeout_s
            self._attempt = sender._attempt(self._job, deadline)
        assert self._attempt is not None
        wake = self._attempt.step()
        if wake is not None:
            return wake
        job, outcome = self._job, self._attempt.outcome
        self._job = self._attempt = None
        sender._run(job, outcome)
        self._free_since = time.monotonic()
        return self._free_since  # the next job, after the tasks already due


class EdgeKeys:
    """The keys of one payload edge: its sender and its receiver build them alike."""

    from_stage: int | str
    to_stage: int | str
    from_rank: int
    to_rank: int

    def key(self, request_id: str, chunk: int | None) -> str:
        return payload_key(
            request_id,
            self.from_stage,
            self.to_stage,
            chunk=chunk,
            from_rank=self.from_rank,
            to_rank=self.to_rank,
        )


class PayloadSender(EdgeKeys):
    """Puts payload envelopes of one edge on ``workers`` background threads (see the ordering
    contract: in order within a request, independent across requests).

    ``status(request_id)`` is ``"pending"`` while puts are queued or running, then ``"done"``
    once the final put landed, or ``"failed: <reason>"``; :meth:`forget` drops it.

    Every put that landed rings the sender's doorbell (:mod:`vllm_kvbridge.runner.doorbell`,
    ``bell=False``: none), so receivers that know it (:meth:`receiver_info`, the sender info
    a pipeline forwards) wake on the arrival instead of their next poll.
    """

    def __init__(
        self,
        connector: Connector,
        from_stage: int | str,
        to_stage: int | str,
        *,
        from_rank: int = 0,
        to_rank: int = 0,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        send_timeout_s: float = 60.0,
        workers: int = SEND_WORKERS,
        bell: bool = True,
    ) -> None:
        if workers < 1:
            raise ConfigError(f"payload sender needs at least one worker, got {workers}")
        self.connector = connector
        self.from_stage, self.to_stage = from_stage, to_stage
        self.from_rank, self.to_rank = from_rank, to_rank
        self.retries, self.backoff_s, self.max_backoff_s = retries, backoff_s, max_backoff_s
        self.send_timeout_s = send_timeout_s
        self._stop = threading.Event()  # ends waits for room once close() gave up waiting
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[_PutJob] = deque()
        self._queued: dict[str, int] = {}  # request id -> queued or running jobs
        self._running: set[str] = set()  # requests with a lane (a put in progress or queued)
        self._status: dict[str, str] = {}
        self._final_seen: set[str] = set()
        self._next_chunk: dict[str, int] = {}
        self._closed = False
        self.last_metadata: dict[str, Any] = {}
        #: called (no lock held, on an I/O thread) when a request's last queued put ended
        #: and its status is done or failed: its owner reports it without being asked
        self.on_settled: Callable[[str], None] | None = None
        self._bell = Bell() if bell else None
        # Started now: the edge's threads exist before its first request.
        self._scheduler = PutScheduler(f"kvbridge-payload-send-{to_stage}", workers, start=True)

    def receiver_info(self) -> dict[str, Any]:
        """What a receiver needs from this sender: the connector's metadata (of the last put,
        else what it says up front: a ZMQ endpoint) and the doorbell's endpoint."""
        info = dict(self.last_metadata or self.connector.receiver_metadata())
        endpoint = self._bell.endpoint() if self._bell is not None else None
        if endpoint is not None:
            info[BELL_KEY] = endpoint
        return info

    def _enqueue(self, job: _PutJob, final: bool) -> None:
        with self._lock:
            if self._closed:
                raise TransferError("payload sender is closed")
            if job.request_id in self._final_seen:
                raise TransferError(f"request {job.request_id!r}: payload already finished")
            self._queue.append(job)
            self._queued[job.request_id] = self._queued.get(job.request_id, 0) + 1
            self._status.setdefault(job.request_id, "pending")
            if self._status[job.request_id] == "done":
                self._status[job.request_id] = "pending"
            if final:
                self._final_seen.add(job.request_id)
            if job.request_id not in self._running:
                self._running.add(job.request_id)
                self._scheduler.submit(_Lane(self, job.request_id))

    def send_full(self, request_id: str, payload: Mapping[str, Any]) -> None:
        """Queue a request's one and only payload."""
        self._enqueue(
            _PutJob(request_id, self.key(request_id, None), make_envelope(FULL, request_id, payload)),
            final=True,
        )

    def send_chunk(self, request_id: str, payload: Mapping[str, Any] | None, *, final: bool = False) -> int:
        """Queue the request's next chunk (ids assigned here, in call order); return its id."""
        with self._lock:
            index = self._next_chunk.get(request_id, 0)
            self._next_chunk[request_id] = index + 1
        env = make_envelope(CHUNK, request_id, payload, chunk=index, final=final)
        self._enqueue(_PutJob(request_id, self.key(request_id, index), env), final=final)
        return index

    def abort(self, request_id: str, reason: str = "aborted by the sender", *, chunked: bool) -> None:
        """Drop the request's queued puts and queue an abort envelope in their place."""
        with self._lock:
            if self._closed:
                return
            kept = deque(j for j in self._queue if j.request_id != request_id)
            dropped = [j for j in self._queue if j.request_id == request_id]
            self._queue = kept
            if dropped:
                self._queued[request_id] -= len(dropped)
            if chunked:
                # The abort takes the place of the first chunk that will not be put, so the
                # receiver's stream has no hole before it.
                index = min(
                    (j.envelope[ENVELOPE_KEY]["chunk"] for j in dropped),
                    default=self._next_chunk.get(request_id, 0),
                )
                self._next_chunk[request_id] = index + 1
            else:
                index = None
            self._final_seen.discard(request_id)
        env = make_envelope(ABORT, request_id, None, chunk=index, final=True, error=reason)
        self._enqueue(_PutJob(request_id, self.key(request_id, index), env), final=True)

    def status(self, request_id: str) -> str | None:
        with self._lock:
            return self._status.get(request_id)

    def in_flight(self, request_id: str | None = None) -> int:
        with self._lock:
            if request_id is None:
                return sum(self._queued.values())
            return self._queued.get(request_id, 0)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's bookkeeping (its status reads None afterwards)."""
        with self._lock:
            if self._queued.get(request_id):
                raise TransferError(f"request {request_id!r} still has payload puts in flight")
            for table in (self._status, self._next_chunk, self._queued):
                table.pop(request_id, None)
            self._final_seen.discard(request_id)

    def tracked(self) -> set[str]:
        with self._lock:
            return set(self._status) | set(self._next_chunk) | set(self._queued)

    def _attempt(self, job: _PutJob, deadline: float) -> PutAttempt:
        """The put of ``job`` with retries, waiting for room until ``deadline``."""
        return PutAttempt(
            lambda: self.connector.put(self.from_stage, self.to_stage, job.key, job.envelope),
            retries=self.retries,
            backoff=lambda i: min(self.backoff_s * 2**i, self.max_backoff_s),
            send_timeout_s=self.send_timeout_s,
            deadline=deadline,
            stop=self._stop,
        )

    def _next_job(self, request_id: str) -> _PutJob | None:
        """Take the oldest queued job of ``request_id``; None (and its lane is over) when
        there is none."""
        with self._lock:
            for i, job in enumerate(self._queue):
                if job.request_id == request_id:
                    del self._queue[i]
                    return job
            self._running.discard(request_id)
            self._wake.notify_all()
            return None

    def _run(self, job: _PutJob, outcome: PutOutcome) -> None:
        """``job``'s put is over: record how, ring the bell, tell the receiver of a failure."""
        error = None
        if outcome.result is None:
            error = f"put of {job.key} failed: {outcome.error}"
        else:
            self.last_metadata = dict(outcome.result.metadata)
        kind = job.envelope[ENVELOPE_KEY]["kind"]
        final = job.envelope[ENVELOPE_KEY]["final"]
        abort_after = False
        with self._lock:
            self._queued[job.request_id] -= 1
            if error is not None:
                logger.error("payload send of request %s failed: %s", job.request_id, error)
                self._status[job.request_id] = f"failed: {error}"
                # Later puts of this request would leave a hole in the stream.
                self._queue = deque(j for j in self._queue if j.request_id != job.request_id)
                self._queued[job.request_id] = 0
                abort_after = kind != ABORT
            elif kind == ABORT:
                self._status[job.request_id] = f"failed: {job.envelope[ENVELOPE_KEY]['error']}"
            elif final and not is_failed(self._status[job.request_id]):
                self._status[job.request_id] = "done"
            # After the status: the request's last put ended and it reads done or failed.
            settled = self._queued[job.request_id] == 0 and self._status[job.request_id] != "pending"
        if error is None and self._bell is not None:
            # After the status: a receiver the ring wakes finds the put landed and recorded.
            self._bell.ring(job.key)
        if abort_after:
            # Best effort: tell the receiver now instead of letting it stall.
            chunk = job.envelope[ENVELOPE_KEY]["chunk"]
            env = make_envelope(ABORT, job.request_id, None, chunk=chunk, final=True, error=error)
            try:
                self.connector.put(self.from_stage, self.to_stage, job.key, env)
            except Exception:
                pass
        if settled and self.on_settled is not None:
            try:
                self.on_settled(job.request_id)
            except Exception:  # the owner's report; never this I/O thread's death
                logger.exception("kvbridge: reporting settled payload of %s failed", job.request_id)

    def threads_alive(self) -> int:
        return self._scheduler.threads_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued puts (up to ``timeout``), stop the threads. Idempotent."""
        end = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            while self._running and (left := end - time.monotonic()) > 0:
                self._wake.wait(left)
        self._stop.set()  # a put still waiting for room gives up (its request fails)
        self._scheduler.hurry()
        alive = self._scheduler.close(0.5)
        if alive:
            logger.warning("%d payload sender threads did not stop within %.1f s", alive, timeout)
        if self._bell is not None:
            self._bell.close()  # a put still running rings nothing (ring never raises)


# -- TP fan-out --------------------------------------------------------------------------------


def broadcast_payload(
    payload: Mapping[str, Any] | BaseException | None, group: Any, src: int = 0
) -> dict[str, Any]:
    """Give every rank of ``group`` the payload rank ``src`` holds (one packed buffer,
    :func:`~vllm_kvbridge.wire.group_broadcast.broadcast_buffers`).

    Every rank calls this, in the same order. On ``src`` pass the payload, or the exception
    its receive raised (the other ranks then raise a TransferError with its message).
    """
    import torch.distributed as dist

    from vllm_kvbridge.wire import decode_packed, encode
    from vllm_kvbridge.wire.group_broadcast import broadcast_buffers

    what = "payload fan-out"
    if dist.get_rank(group) != src:
        (buf,) = broadcast_buffers(None, group, src, what=what)
        return decode_packed(buf.numpy(), copy=True)
    if isinstance(payload, BaseException) or payload is None:
        reason = str(payload) if payload is not None else "no payload"
        broadcast_buffers(reason, group, src, what=what)
        if isinstance(payload, BaseException):
            raise payload
        raise TransferError(f"{what} from rank {src} failed: {reason}")
    enc = encode(dict(payload))
    buf = torch.empty(enc.packed_size(), dtype=torch.uint8)
    enc.pack_into(buf.numpy())
    broadcast_buffers([buf], group, src, what=what)
    return dict(payload)


def chunked(seq: Sequence[Any], size: int) -> list[Sequence[Any]]:
    """Split ``seq`` into pieces of ``size`` (last one shorter); helper for tests and producers."""
    return [seq[i : i + size] for i in range(0, len(seq), size)]
