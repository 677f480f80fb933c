"""``PayloadReceiver``: receives the payloads of one edge on a background thread.

The wire form (envelopes), the merge rule and the ordering contract it keeps are those of
:mod:`vllm_kvbridge.runner.payload_stream`; the sender is
:class:`~vllm_kvbridge.runner.payload_stream.PayloadSender`.

Waking: the thread tries each stream's next key and, when nothing came, sleeps (1 ms,
doubling up to ``max_poll_interval_s``). A stream whose metadata names the sender's
doorbell (``metadata["bell"]``, :mod:`vllm_kvbridge.runner.doorbell`) also ends that sleep
the moment a put of its lands, so a payload is seen on arrival, not up to one poll interval
later; the timer stays as the fallback (a lost ring, a sender on another host).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.errors import ConfigError, KVBridgeError, TransferCorrupt, TransferError, TransferTimeout
from vllm_kvbridge.runner.doorbell import BELL_KEY, BellListener
from vllm_kvbridge.runner.payload_stream import (
    ABORT,
    CHUNK,
    EdgeKeys,
    PayloadAborted,
    merge_payloads,
    open_envelope,
)

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    request_id: str
    chunked: bool
    metadata: Mapping[str, Any] | None
    deadline: float
    next_chunk: int = 0
    chunks: list[dict[str, Any]] = field(default_factory=list)
    state: str = "receiving"  # receiving | done | failed | cancelled
    error: BaseException | None = None
    on_chunk: Callable[[str, int, dict[str, Any]], None] | None = None
    timing: ReceiveTiming = field(default_factory=lambda: ReceiveTiming(time.perf_counter()))


@dataclass
class ReceiveTiming:
    """Where a request's receive time went (``time.perf_counter`` seconds).

    ``get_s`` is the transfer itself: the time spent in the connector's gets that returned
    data (reading and decoding every piece). ``waited_s`` is from :meth:`PayloadReceiver.expect`
    to the last piece: for a stream it includes the producer generating it. ``ready_at``
    is ``time.time()`` when the payload was complete (one clock for the processes of a host).
    """

    expected: float
    get_s: float = 0.0
    done: float = 0.0
    ready_at: float = 0.0

    @property
    def waited_s(self) -> float:
        return max(0.0, self.done - self.expected) if self.done else 0.0


class PayloadReceiver(EdgeKeys):
    """Receives the payloads of one edge on a background thread.

    ``mode`` is ``"full"`` or ``"async_chunk"``. :meth:`expect` starts receiving a request:
    a full payload must arrive within ``recv_timeout_s``; a stream's first chunk within
    ``recv_timeout_s`` and each later chunk within ``stall_timeout_s`` of the previous one,
    else the request fails with :class:`TransferTimeout`. :meth:`result` waits for the
    request and returns its payload (chunks merged) or raises its error, then forgets it;
    :meth:`iter_chunks` yields chunks in order as they arrive; :meth:`cancel` stops it.
    """

    def __init__(
        self,
        connector: Connector,
        from_stage: int | str,
        to_stage: int | str,
        *,
        mode: str = "full",
        recv_timeout_s: float = 30.0,
        stall_timeout_s: float = 30.0,
        replace_keys: Iterable[str] = (),
        from_rank: int = 0,
        to_rank: int = 0,
        poll_interval_s: float = 0.001,
        max_poll_interval_s: float = 0.02,
        close_connector: bool = False,
    ) -> None:
        if mode not in ("full", "async_chunk"):
            raise ConfigError(f"payload receiver mode must be 'full' or 'async_chunk', got {mode!r}")
        for name, value in (("recv_timeout_s", recv_timeout_s), ("stall_timeout_s", stall_timeout_s)):
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value!r}")
        self.connector = connector
        self.from_stage, self.to_stage = from_stage, to_stage
        self.from_rank, self.to_rank = from_rank, to_rank
        self.mode = mode
        self.recv_timeout_s, self.stall_timeout_s = recv_timeout_s, stall_timeout_s
        self.replace_keys = tuple(replace_keys)
        self.poll_interval_s, self.max_poll_interval_s = poll_interval_s, max_poll_interval_s
        self._close_connector = close_connector
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._streams: dict[str, _Stream] = {}
        self._sender_info: dict[str, Any] | None = None
        self._closed = False
        self._bells = BellListener()
        self._thread = threading.Thread(
            target=self._loop, name=f"kvbridge-payload-recv-{from_stage}", daemon=True
        )
        self._thread.start()

    def update_sender_info(self, metadata: Mapping[str, Any] | None) -> None:
        """Connector metadata (e.g. the sender's ZMQ endpoint) used when :meth:`expect` gets none."""
        with self._lock:
            self._sender_info = dict(metadata) if metadata else None

    def expect(
        self,
        request_id: str,
        *,
        metadata: Mapping[str, Any] | None = None,
        on_chunk: Callable[[str, int, dict[str, Any]], None] | None = None,
    ) -> None:
        """Start receiving ``request_id`` (``on_chunk(rid, index, data)`` runs on the receive thread)."""
        with self._lock:
            if self._closed:
                raise TransferError("payload receiver is closed")
            if request_id in self._streams:
                raise TransferError(f"request {request_id!r} is already expected")
            self._streams[request_id] = _Stream(
                request_id,
                self.mode == "async_chunk",
                metadata if metadata is not None else self._sender_info,
                time.monotonic() + self.recv_timeout_s,
                on_chunk=on_chunk,
            )
        self._bells.wake()

    def pending(self) -> set[str]:
        with self._lock:
            return set(self._streams)

    def status(self, request_id: str) -> tuple[str, BaseException | None] | None:
        """``(state, error)`` of an expected request without waiting or forgetting it: state
        ``receiving``, ``done`` (every chunk arrived), ``failed`` (a stall, the sender's abort,
        a corrupt chunk: ``error`` says which) or ``cancelled``; None when not expected."""
        with self._lock:
            stream = self._streams.get(request_id)
            return None if stream is None else (stream.state, stream.error)

    def timing(self, request_id: str) -> ReceiveTiming | None:
        """The :class:`ReceiveTiming` of an expected request so far (a copy); None when not expected."""
        with self._lock:
            stream = self._streams.get(request_id)
            return None if stream is None else dataclasses.replace(stream.timing)

    def _finish(self, stream: _Stream, state: str, error: BaseException | None = None) -> None:
        # Called with the lock held.
        if stream.state != "receiving":
            return
        stream.state, stream.error = state, error
        self._cond.notify_all()

    def cancel(self, request_id: str) -> bool:
        """Stop receiving; waiters get a TransferError. Returns False if it was not expected."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return False
            self._finish(stream, "cancelled", TransferError(f"request {request_id!r}: receive cancelled"))
            return True

    def withdraw(self, request_id: str) -> bool:
        """Cancel ``request_id`` unless its payload is complete (its sender was lost): True
        when it was still receiving and is cancelled now, False when it was read (complete,
        or taken already) or is not expected. Decided under the receive thread's lock, so a
        payload that completed is never given up."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None or stream.state != "receiving":
                return False
            del self._streams[request_id]
            self._finish(stream, "cancelled", TransferError(f"request {request_id!r}: receive withdrawn"))
            return True

    def _take(self, request_id: str, timeout: float | None) -> _Stream:
        end = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None:
                raise TransferError(f"request {request_id!r} is not expected by this receiver")
            while stream.state == "receiving":
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferTimeout(f"request {request_id!r}: payload not complete within {timeout} s")
                self._cond.wait(left)
            self._streams.pop(request_id, None)
            return stream

    def result(self, request_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the request; return its payload (chunks merged) or raise its error. Forgets it."""
        return self.result_timed(request_id, timeout)[0]

    def result_timed(
        self, request_id: str, timeout: float | None = None
    ) -> tuple[dict[str, Any], ReceiveTiming]:
        """:meth:`result` with the request's :class:`ReceiveTiming`."""
        stream = self._take(request_id, timeout)
        if stream.error is not None:
            raise stream.error
        return merge_payloads(stream.chunks, self.replace_keys), stream.timing

    def iter_chunks(self, request_id: str, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield the request's chunks in order as they arrive; raises its error; forgets it at the end."""
        index = 0
        while True:
            with self._lock:
                stream = self._streams.get(request_id)
                if stream is None:
                    raise TransferError(f"request {request_id!r} is not expected by this receiver")
                while index >= len(stream.chunks) and stream.state == "receiving":
                    if not self._cond.wait(timeout):
                        raise TransferTimeout(f"request {request_id!r}: no chunk {index} within {timeout} s")
                if index < len(stream.chunks):
                    chunk = stream.chunks[index]
                else:
                    self._streams.pop(request_id, None)
                    if stream.error is not None:
                        raise stream.error
                    return
            index += 1
            yield chunk

    def _poll_one(self, stream: _Stream, now: float) -> bool:
        """One non-blocking get for ``stream``; returns True when something arrived or ended."""
        chunk = stream.next_chunk if stream.chunked else None
        key = self.key(stream.request_id, chunk)
        try:
            start = time.perf_counter()
            got = self.connector.get(self.from_stage, self.to_stage, key, stream.metadata)
            if got is not None:
                stream.timing.get_s += time.perf_counter() - start
            if got is None:
                if now > stream.deadline:
                    what = f"chunk {chunk}" if stream.chunked else "payload"
                    limit = self.stall_timeout_s if stream.chunked and chunk else self.recv_timeout_s
                    raise TransferTimeout(
                        f"request {stream.request_id!r}: {what} from stage {self.from_stage} did not arrive "
                        f"within {limit} s" + (" (stream stalled)" if stream.chunked and chunk else "")
                    )
                return False
            kind, final, data, error = open_envelope(got, stream.request_id, chunk)
            if kind == ABORT:
                raise PayloadAborted(
                    f"request {stream.request_id!r}: sender stage {self.from_stage} "
                    f"aborted the payload: {error}"
                )
            if (kind == CHUNK) != stream.chunked:
                raise TransferCorrupt(
                    f"request {stream.request_id!r}: got a {kind} envelope on a {self.mode} edge"
                )
        except KVBridgeError as exc:
            with self._lock:
                self._finish(stream, "failed", exc)
            return True
        except Exception as exc:  # a connector bug must fail the request, not kill the thread
            with self._lock:
                self._finish(stream, "failed", TransferError(f"request {stream.request_id!r}: {exc!r}"))
            return True
        if stream.on_chunk is not None and data is not None:
            try:
                stream.on_chunk(stream.request_id, chunk or 0, data)
            except Exception:
                logger.exception("on_chunk callback of request %s failed", stream.request_id)
        with self._lock:
            if stream.state != "receiving":
                return True  # cancelled meanwhile: drop what arrived
            if data is not None:
                stream.chunks.append(data)
            stream.next_chunk += 1
            stream.deadline = time.monotonic() + self.stall_timeout_s
            if final or not stream.chunked:
                stream.timing.done, stream.timing.ready_at = time.perf_counter(), time.time()
                self._finish(stream, "done")
            else:
                self._cond.notify_all()
        return True

    def _drain(self, stream: _Stream, now: float) -> bool:
        """Get what is there for ``stream``, up to 64 pieces (so one request cannot starve
        the others); True when something arrived."""
        progressed = False
        for _ in range(64):
            if not self._poll_one(stream, now) or stream.state != "receiving":
                break
            progressed = True
        return progressed

    def _loop(self) -> None:
        try:
            self._run_loop()
        finally:
            self._bells.close()

    def _run_loop(self) -> None:
        interval = self.poll_interval_s
        next_full = 0.0  # when every stream is tried again (the timer: the fallback)
        rung: list[str] = []
        while True:
            with self._lock:
                if self._closed:
                    return
                active = [s for s in self._streams.values() if s.state == "receiving"]
            for stream in active:
                bell = (stream.metadata or {}).get(BELL_KEY)
                if isinstance(bell, str):
                    self._bells.subscribe(bell)
            now = time.monotonic()
            full = now >= next_full
            if full:
                targets = active
            else:
                # A bell rang: try only the streams whose next key it named (with a remote
                # connector every try is a round trip to the sender).
                keys = set(rung)
                targets = [
                    s for s in active if self.key(s.request_id, s.next_chunk if s.chunked else None) in keys
                ]
            progressed = False
            for stream in targets:
                progressed = self._drain(stream, now) or progressed
            if progressed:  # more may be there: try every stream again at once
                interval, next_full, rung = self.poll_interval_s, 0.0, []
                continue
            if full:
                next_full = now + interval
                interval = min(interval * 2, self.max_poll_interval_s)
            timeout = max(0.0, next_full - time.monotonic()) if active else 0.1
            kicked, rung = self._bells.wait(timeout)
            if kicked:  # a stream was added (its payload may be there already) or closing
                next_full = 0.0

    def threads_alive(self) -> int:
        return int(self._thread.is_alive())

    def close(self, timeout: float = 5.0) -> None:
        """Fail every pending request, stop the thread (and close the connector if owned)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for stream in self._streams.values():
                self._finish(
                    stream, "cancelled", TransferError(f"request {stream.request_id!r}: receiver closed")
                )
            self._streams.clear()
        self._bells.wake()
        self._thread.join(timeout)
        if self._close_connector:
            self.connector.close()
