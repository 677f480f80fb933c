"""The engines a stage process drives: one class per stage kind.

A :class:`StageEngine` is driven by the stage process's single-threaded serve loop
(which owns the control socket): ``submit`` queues a request, ``step`` makes progress and
returns the messages to send (``StageDone`` / ``RequestFailed``, and ``StageProgress`` for
requests submitted with ``stream`` by engines that can report partial output), ``busy`` says whether
``step`` has work (the loop then polls its socket without sleeping), ``abort`` drops
requests, ``close`` releases everything. ``step`` must not block for long: slow work
(KV receives, denoising) runs on the engine's own worker thread.

An engine whose background work completes while ``busy`` says no (a payload received on a
thread) offers a :class:`Waker` (``waker()``): the loop sleeps on it together with its
socket, so that work is picked up when it completes, neither up to a poll interval later
nor by spinning on ``busy`` meanwhile.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from abc import ABC, abstractmethod
from typing import Any

from vllm_kvbridge.config.resolve import ResolvedStage
from vllm_kvbridge.errors import RequestCancelled
from vllm_kvbridge.pipeline import messages as m


class Waker:
    """A descriptor that background threads make readable (:meth:`ring`, thread-safe) to wake
    the serve loop polling it; the loop calls :meth:`clear` when it woke."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def ring(self) -> None:
        if self._closed:
            return  # the descriptors may name another file by now
        try:
            os.write(self._w, b"\0")
        except OSError:
            pass  # full (a wake is pending) or closed

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._r)
            os.close(self._w)


class StageEngine(ABC):
    def __init__(self, stage: ResolvedStage) -> None:
        self.stage = stage

    def info(self) -> dict[str, Any]:
        return {"kind": self.stage.kind}

    def waker(self) -> Waker | None:
        """What wakes the serve loop when background work completes (see the module
        docstring); None: ``busy`` reports all the work there is."""
        return None

    @abstractmethod
    def submit(self, msg: m.Submit) -> None: ...

    @abstractmethod
    def step(self) -> list[m.StageDone | m.StageProgress | m.RequestFailed]: ...

    @abstractmethod
    def busy(self) -> bool: ...

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None: ...

    def producer_lost(self, msg: m.ProducerLost) -> list[m.RequestFailed]:
        """Give up those of ``msg.request_ids`` whose data from the lost stage died unread
        (see :class:`~vllm_kvbridge.pipeline.messages.ProducerLost`); their failures, to send.
        A stage that receives nothing from other stages has nothing to give up."""
        return []

    def edge_counters(self) -> dict[str, float]:
        """Counters of this stage's connectors (:class:`~vllm_kvbridge.pipeline.messages.StageStats`);
        empty for a stage that moves nothing itself."""
        return {}

    @abstractmethod
    def close(self) -> None: ...


def producer_lost_failure(
    msg: m.ProducerLost, request_id: str, stage: ResolvedStage, what: str
) -> m.RequestFailed:
    """The failure of a request of ``stage`` whose ``what`` (``"KV"``, ``"payload"``) died
    unread with its producer (named, and set as ``lost_stage``)."""
    edge = next((e for e in stage.inputs if e.from_stage == msg.stage_id), None)
    over = f" ({edge.connector.name} serves unread data from the sender's process)" if edge else ""
    error = f"stage {msg.stage_id} ({msg.kind}) was lost before stage {stage.stage_id} read its {what}{over}"
    return m.RequestFailed(request_id, stage.stage_id, error, lost_stage=msg.stage_id)


#: How long a stage (and the orchestrator, which refuses such ids) remembers a request that
#: was aborted or failed: its late output is dropped, its late KV withdrawn.
ABORTED_KEEP_S = 600.0


class ExpiringIds:
    """A set of request ids that forgets each id ``keep_s`` after it was added (and the
    oldest beyond ``max_items``): aborted ids are only needed while late output of theirs
    can still arrive, and an abort of a request that already finished adds an id nobody
    ever removes. Not thread-safe (the serve loop, or under the engine's lock)."""

    def __init__(self, keep_s: float = ABORTED_KEEP_S, max_items: int = 10_000) -> None:
        self._added: dict[str, float] = {}
        self._keep_s, self._max_items = keep_s, max_items

    def _prune(self) -> None:
        cutoff = time.monotonic() - self._keep_s
        while self._added and (
            len(self._added) > self._max_items or next(iter(self._added.values())) < cutoff
        ):
            del self._added[next(iter(self._added))]

    def add(self, request_id: str) -> None:
        self._added.pop(request_id, None)
        self._added[request_id] = time.monotonic()
        self._prune()

    def update(self, request_ids: Any) -> None:
        for rid in request_ids:
            self.add(rid)

    def discard(self, request_id: str) -> None:
        self._added.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._added

    def __len__(self) -> int:
        return len(self._added)


def drain_results(done: queue.SimpleQueue) -> list[m.StageDone | m.RequestFailed]:
    """Results a background worker thread queued since the last step.

    An exception the worker queued is raised here, on the serve loop, so it fails the stage
    (reported as ``StageFailed``) instead of dying silently with the thread.
    """
    out: list[m.StageDone | m.RequestFailed] = []
    while not done.empty():
        item = done.get()
        if isinstance(item, BaseException):
            raise item
        out.append(item)
    return out


def build_engine(stage: ResolvedStage) -> StageEngine:
    if stage.kind == "diffusion":
        return DiffusionStageEngine(stage)
    if stage.kind == "vocoder":
        from vllm_kvbridge.pipeline.vocoder_engine import VocoderStageEngine

        return VocoderStageEngine(stage)
    if stage.url is not None:
        from vllm_kvbridge.pipeline.http_engine import HTTPStageEngine

        return HTTPStageEngine(stage)
    from vllm_kvbridge.pipeline.llm_engine import LLMStageEngine

    return LLMStageEngine(stage)


class DiffusionStageEngine(StageEngine):
    """Runs :class:`~vllm_kvbridge.runner.diffusion_runner.DiffusionRunner` on a worker thread.

    Requests run in batches of up to ``diffusion.max_batch_size`` (1 by default: one at a
    time, in arrival order). Policy (:func:`~vllm_kvbridge.runner.diffusion_batch.select_batch`):
    when the worker becomes free it takes the queue head and, in arrival order, the queued
    requests with the head's ``num_steps``, up to ``max_batch_size``; the others wait for a
    later batch. Requests join only at step 0: one arriving while a batch denoises waits
    for the next batch (the worker never waits for a batch to fill). While a batch
    denoises, the KV of the next batch is prefetched (as it stands when the batch forms,
    plus, with ``max_batch_size`` > 1, requests submitted meanwhile that fall within the
    next batch's places). Per-request errors (a KV that never arrives) become
    ``RequestFailed`` of that request alone; an aborted request leaves its batch at the
    next step and reports nothing; the worker thread itself never dies on one.
    """

    def __init__(self, stage: ResolvedStage) -> None:
        super().__init__(stage)
        from vllm_kvbridge.runner.diffusion_runner import DiffusionRunner

        #: rank 1 of a 2-rank stage (``diffusion.num_ranks: 2``, see pipeline/dit_rank.py)
        self._rank1: Any = None
        self._group: Any = None
        if int((stage.diffusion or {}).get("num_ranks", 1)) == 2:
            from vllm_kvbridge.pipeline.dit_rank import start_ranks

            self._rank1, self._group = start_ranks(stage)
        try:
            self.runner = DiffusionRunner(stage, cfg_group=self._group)
        except BaseException:
            self._stop_ranks()
            raise
        self._lock = threading.Lock()
        self._queue: list[tuple[m.Submit, Any]] = []
        self._wakeup = threading.Event()
        self._done: queue.SimpleQueue[m.StageDone | m.RequestFailed | BaseException] = queue.SimpleQueue()
        self._aborted = ExpiringIds()
        #: requests given up because their KV died unread with its producer (already reported)
        self._lost = ExpiringIds()
        self._current: list[tuple[m.Submit, Any]] = []  # the batch popped, being received/denoised
        self._pending = 0
        self._stop = False
        # A queued request whose KV arrives may now run ahead of a late one: wake up for it.
        self.runner.on_kv_ready(self._wakeup.set)
        self._thread = threading.Thread(target=self._work, name="kvbridge-diffusion", daemon=True)
        self._thread.start()

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"kind": "diffusion", "latent_shape": list(self.runner.module.latent_shape)}
        if self._rank1 is not None:
            info["rank_pids"] = [os.getpid(), self._rank1.pid]
        return info

    def _request(self, msg: m.Submit) -> Any:
        from vllm_kvbridge.runner.diffusion_runner import DiffusionRequest

        up = msg.upstream[0] if msg.upstream else m.Upstream(-1, msg.request_id)
        params = msg.sampling_params
        scale = params.get("guidance_scale")
        return DiffusionRequest(
            msg.request_id,
            up.transfer_request_id,
            up.from_stage,
            dict(up.sender_info),
            seed=params.get("seed"),
            num_steps=params.get("num_steps"),
            guidance_scale=None if scale is None else float(scale),
            cfg_purposes=sorted(msg.companions),
        )

    def submit(self, msg: m.Submit) -> None:
        req = self._request(msg)
        # A queue longer than the sender's TTL must not lose its tail's KV: renew it.
        self._safe(lambda: self.runner.hold_kv(req))
        with self._lock:
            # Submitted while a batch runs, within the next batch's places: prefetch it now so
            # its receive overlaps the running denoise (a batch of one keeps the old rule:
            # only the next request, when its predecessor starts). Started under the lock,
            # so the worker cannot have consumed it already (a late prefetch would wait
            # for KV that is gone).
            size = self.runner.max_batch_size
            if size > 1 and self._current and len(self._queue) < size:
                self._safe(lambda: self.runner.prefetch(req))
            self._queue.append((msg, req))
            self._pending += 1
        self._wakeup.set()

    def busy(self) -> bool:
        return not self._done.empty()

    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            self._aborted.update(request_ids)

    def _is_aborted(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._aborted

    def producer_lost(self, msg: m.ProducerLost) -> list[m.RequestFailed]:
        wanted, out = set(msg.request_ids), []
        with self._lock:  # the worker pops and starts requests under it: none slips by
            held = [*self._queue, *self._current]
            for sub, req in held:
                rid = sub.request_id
                if rid not in wanted or req.from_stage != msg.stage_id or rid in self._aborted:
                    continue
                # Decided once, in the KV manager: read already (kept) or withdrawn (failed).
                if self.runner.withdraw_lost_kv(req):
                    self._lost.add(rid)
                    self._aborted.add(rid)  # the worker skips it, or stops its denoise
                    out.append(producer_lost_failure(msg, rid, self.stage, "KV"))
        return out

    def edge_counters(self) -> dict[str, float]:
        return self.runner.transport.runtime.edge_counters()

    def step(self) -> list[m.StageDone | m.RequestFailed]:
        if self._rank1 is not None and self._rank1.poll() is not None:
            raise RuntimeError(f"rank 1 of this diffusion stage exited with status {self._rank1.returncode}")
        return drain_results(self._done)

    def _work(self) -> None:
        try:
            waiting = False  # nothing queued was ready: sleep until a KV arrives
            while True:
                with self._lock:
                    idle = (waiting or not self._queue) and not self._stop
                if idle:  # queued work is taken at once, not on the next wakeup
                    self._wakeup.wait(0.1)
                with self._lock:
                    self._wakeup.clear()
                    if self._stop:
                        return
                    if not self._queue:
                        continue
                    batch, dropped = self._take_batch()
                    waiting = not batch and not dropped
                    self._current = batch
                    nxt = [self._queue[i][1] for i in self._select(self._queue)[0]]
                try:
                    for _, req, lost in dropped:
                        self._drop(req, lost)
                    if batch:
                        self._run(batch, nxt)
                finally:
                    with self._lock:
                        self._current = []
                        for msg, *_ in [*batch, *dropped]:
                            self._lost.discard(msg.request_id)
                    for _, req, *_ in [*batch, *dropped]:
                        self._safe(lambda r=req: self.runner.forget_kv(r))
        except BaseException as exc:  # an engine bug: fail the stage, loudly
            traceback.print_exc()
            self._done.put(exc)

    def _select(self, entries: list[tuple[m.Submit, Any]]) -> tuple[list[int], list[int]]:
        from vllm_kvbridge.runner.diffusion_batch import select_batch

        return select_batch(
            entries,
            self.runner.max_batch_size,
            lambda e: self.runner.steps_of(e[1]),
            lambda e: e[0].request_id in self._aborted,
            lambda e: self.runner.kv_ready(e[1]),
        )

    def _take_batch(self) -> tuple[list[tuple[m.Submit, Any]], list[tuple[m.Submit, Any, bool]]]:
        """Pop the next batch off the queue (under the lock), and the aborted / lost
        requests the selection passed (``(msg, req, lost)``: to drop now)."""
        picked, skipped = self._select(self._queue)
        batch = [self._queue[i] for i in picked]
        dropped = []
        for i in skipped:
            msg, req = self._queue[i]
            dropped.append((msg, req, msg.request_id in self._lost))
            self._aborted.discard(msg.request_id)
        gone = set(picked) | set(skipped)
        self._queue = [e for i, e in enumerate(self._queue) if i not in gone]
        return batch, dropped

    def _drop(self, req: Any, lost: bool) -> None:
        """A request aborted (or lost) while it was queued: it never runs."""
        self._safe(lambda r=req: self.runner.release_kv(r))
        if lost:  # reported when its producer was lost; its KV is gone with it
            return
        # The producer reports a request done only once its KV send completed, so the KV
        # is there: consume it now so its segment/keys are freed at once instead of
        # waiting for the connector's TTL.
        if req.from_stage >= 0 and self.runner.need_kv:
            self._safe(lambda r=req: self.runner.receive_kv(r))

    def _run(self, batch: list[tuple[m.Submit, Any]], nxt: list[Any]) -> None:
        """One batch, popped from the queue (``nxt``: the next batch as it stands, to prefetch)."""
        for _, req in batch:
            self._safe(lambda r=req: self.runner.release_kv(r))
        for n in nxt:
            self._safe(lambda n=n: self.runner.prefetch(n))
        started = time.time()
        results = self.runner.execute_batch(
            [req for _, req in batch],
            [lambda rid=msg.request_id: self._is_aborted(rid) for msg, _ in batch],
        )
        for (msg, req), res in zip(batch, results):
            self._report(msg, req, res, started)

    def _report(self, msg: m.Submit, req: Any, res: Any, started: float) -> None:
        if isinstance(res, RequestCancelled):
            with self._lock:  # aborted mid-way: nobody waits for it, say nothing
                self._aborted.discard(msg.request_id)
            return
        if isinstance(res, Exception):
            with self._lock:
                if msg.request_id in self._lost:  # its receive was withdrawn: reported already
                    return
            self._done.put(
                m.RequestFailed(msg.request_id, self.stage.stage_id, f"{type(res).__name__}: {res}")
            )
            return
        transfers = []
        if req.from_stage >= 0 and self.runner.need_kv:
            # One entry per cache (primary "kv" and each CFG companion); they are
            # received together, so each carries the group's wait.
            transfers = [
                m.TransferStat(
                    req.from_stage, self.stage.stage_id, "kv", n, res.kv_seconds, "receiver", purpose
                )
                for purpose, n in res.kv_transfers.items()
            ]
        self._done.put(
            m.StageDone(
                msg.request_id,
                self.stage.stage_id,
                output={"shape": list(res.image.shape), "batch_size": res.batch_size},
                image=m.tensor_to_msg(res.image),
                started=started,
                finished=time.time(),
                transfers=transfers,
            )
        )

    @staticmethod
    def _safe(fn: Any) -> None:
        try:
            fn()
        except Exception:
            # A failed prefetch is retried by the regular receive, which reports the error;
            # a lease that could not be held leaves the KV to its TTL.
            traceback.print_exc()

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self._wakeup.set()
        self._thread.join(timeout=10)
        try:
            self.runner.close()
        finally:
            self._stop_ranks()

    def _stop_ranks(self) -> None:
        if self._rank1 is not None:
            from vllm_kvbridge.pipeline.dit_rank import stop_ranks

            stop_ranks(self._rank1, self._group)
            self._rank1 = None
