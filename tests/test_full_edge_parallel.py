"""Issue 36 item 5: a full edge is waited out in parallel, and a late KV holds up nobody.

With /dev/shm full, held KV sends drained one at a time (request ``k`` failed after ``k x
send_timeout``), payload puts beyond the sender's four threads waited for a free one, and
the diffusion stage waited a second ``recv_timeout`` for a KV whose prefetch had timed
out, while the requests behind it, whose KV had arrived, waited too. Real connectors and
threads (a shared-memory edge whose ``max_held_bytes`` is full because nobody reads it),
the real sender / runner objects, in-process; every wait ends by a deadline, and the
bounds are generous (each request within twice its timeout of its own start, where the
old code took ``k`` times it).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any

import pytest
import torch
from kv_fixtures import fake_cpu_caches, request_plan
from kv_sender_fixtures import one_segment, receiver, spec, status, wait, worker
from runner_fixtures import send_cfg_kv, shm_entries, shm_namespace

from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.errors import TransferTimeout
from vllm_kvbridge.runner.diffusion_batch import select_batch
from vllm_kvbridge.runner.diffusion_runner import DiffusionRequest, DiffusionRunner
from vllm_kvbridge.runner.payload_stream import PayloadSender

pytestmark = pytest.mark.forked

#: Each request's time to find room; the old code failed request k after k times this.
SEND_TIMEOUT = 2.0
#: Requests sent into the full edge at once.
REQUESTS = 6


@pytest.mark.timeout(120)
@pytest.mark.parametrize("queue_budget", [1 << 30, 1], ids=["puts-wait", "held-in-blocks"])
def test_kv_sends_into_a_full_edge_each_fail_one_send_timeout_after_their_own_start(
    queue_budget: int,
) -> None:
    """The edge holds one request's KV (A's, never read). Six finished requests arrive in
    one step: with the default queue budget they are gathered and their puts wait for
    room; with a one-byte budget the first one's put waits and the others are held in the
    engine's blocks. Each fails about ``send_timeout`` after its own start, naming why
    (the old code: one after the other, the last after 6 x ``send_timeout``)."""
    ns = shm_namespace(f"fullkv{queue_budget}")
    one = one_segment(ns)
    sender = worker(
        ns, max_held_bytes=one + one // 2, send_timeout=SEND_TIMEOUT, max_send_queue_bytes=queue_budget
    )
    rids = [f"B{i}" for i in range(REQUESTS)]
    ended: dict[str, float] = {}
    try:
        sender.send([spec("A")])
        wait(lambda: status(sender, "A") == "done")  # the edge is full from now on
        started = time.monotonic()
        sender.send([spec(rid) for rid in rids])
        end = started + REQUESTS * SEND_TIMEOUT + 30
        while len(ended) < REQUESTS and time.monotonic() < end:  # the engine's next steps
            sender.send([], idle=True)
            for rid in rids:
                if rid not in ended and status(sender, rid) != "pending":
                    ended[rid] = time.monotonic()
        lines = {rid: status(sender, rid) for rid in rids}
        assert set(ended) == set(rids), lines
        for rid in rids:
            assert lines[rid].startswith("failed: "), lines
            assert "edge full for" in lines[rid] or "KV held" in lines[rid], lines
        took = {rid: round(ended[rid] - started, 2) for rid in rids}
        assert all(SEND_TIMEOUT / 2 < t < 2 * SEND_TIMEOUT for t in took.values()), took
        assert sender.take_released() >= {f"e-{rid}" for rid in rids}  # no blocks kept
        assert sender.manager.queued_send_bytes() == 0
        with receiver(ns) as recv:  # room comes back: the next request is delivered
            got, _ = recv.receive_kv_cache_for_request("A")
            del got
            gc.collect()  # A's segment goes back to the sender once its tensors are freed
            sender.send([spec("C")])
            wait(lambda: (sender.send([]), status(sender, "C") == "done")[1])
            assert recv.receive_kv_cache_for_request("C")[0] is not None
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []


@pytest.mark.timeout(120)
def test_payload_puts_into_a_full_edge_each_fail_one_send_timeout_after_their_own_start() -> None:
    """One payload fills the edge (nobody reads it); six requests' payloads are sent at
    once, more than the sender's I/O threads: each fails about ``send_timeout`` after its
    own send, not after the ones the threads served first (the old code: 2 x)."""
    ns = shm_namespace("fullpl")
    payload = {"x": torch.arange(4096, dtype=torch.float32)}
    with create_connector("SharedMemoryConnector", {"namespace": ns}) as probe:
        assert probe.put(0, 1, "probe", payload).ok
        one = probe.health()["held_bytes"]
    conn = create_connector("SharedMemoryConnector", {"namespace": ns, "max_held_bytes": one + one // 2})
    sender = PayloadSender(conn, 0, 1, send_timeout_s=SEND_TIMEOUT, bell=False)
    rids = [f"p{i}" for i in range(REQUESTS)]
    ended: dict[str, float] = {}
    try:
        sender.send_full("filler", payload)
        wait(lambda: sender.status("filler") == "done")
        started = time.monotonic()
        for rid in rids:
            sender.send_full(rid, payload)
        end = started + REQUESTS * SEND_TIMEOUT + 30
        while len(ended) < REQUESTS and time.monotonic() < end:
            for rid in rids:
                if rid not in ended and sender.status(rid) != "pending":
                    ended[rid] = time.monotonic()
            time.sleep(0.01)
        lines = {rid: sender.status(rid) for rid in rids}
        assert set(ended) == set(rids), lines
        assert all(line.startswith("failed: ") and "edge full for" in line for line in lines.values()), lines
        took = {rid: round(ended[rid] - started, 2) for rid in rids}
        assert all(SEND_TIMEOUT / 2 < t < 2 * SEND_TIMEOUT for t in took.values()), took
    finally:
        sender.close(timeout=5)
        conn.close()
    assert shm_entries(ns) == []


# -- the diffusion stage's receive side --------------------------------------------------------

RECV_TIMEOUT = 4.0


def _dit_stage(namespace: str, recv_timeout: float = RECV_TIMEOUT) -> Any:
    cfg = {
        "connectors": {"shm": {"name": "shm", "extra": {"namespace": namespace}}},
        "stages": [
            {"stage_id": 0, "kind": "llm_ar", "model": "m", "kv_transfer": {"need_send_cache": True}},
            {
                "stage_id": 1,
                "kind": "diffusion",
                "kv_transfer": {"need_recv_cache": True, "recv_timeout": recv_timeout, "prefetch": True},
                # model "m" is a placeholder: the fake caches' KV geometry is given here
                "diffusion": {"kwargs": {"image_size": 16, "kv_heads": 2, "kv_head_dim": 32}, "num_steps": 3},
            },
        ],
        "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
    }
    return resolve_spec(spec_from_dict(cfg)).stage(1)


def _dit_leftovers(namespace: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f".{namespace}." in n]


@pytest.mark.timeout(120)
def test_a_kv_whose_prefetch_timed_out_is_not_waited_for_again() -> None:
    """The prefetch is the request's receive, with its one deadline: once it timed out,
    taking the request fails it at once instead of waiting another ``recv_timeout``."""
    ns = f"fullpf{os.getpid()}"
    runner = DiffusionRunner(_dit_stage(ns))
    try:
        late = DiffusionRequest("late", "never-sent", 0, {})
        t0 = time.monotonic()
        runner.prefetch(late)
        wait(
            lambda: runner.transport.runtime.kv_manager.prefetcher.in_flight() == 0, timeout=RECV_TIMEOUT + 30
        )
        assert time.monotonic() - t0 >= RECV_TIMEOUT * 0.9  # the prefetch waited its deadline out
        taken = time.monotonic()
        with pytest.raises(TransferTimeout, match="did not arrive within"):
            runner.execute(late)
        assert time.monotonic() - taken < RECV_TIMEOUT / 2, "waited for the KV a second time"
    finally:
        runner.close()
    assert _dit_leftovers(ns) == []


@pytest.mark.timeout(120)
def test_a_late_kv_does_not_hold_up_a_later_request_whose_kv_is_there() -> None:
    """Queued in this order: ``late`` (its KV never comes) and ``ready`` (sent). The stage's
    policy (``select_batch`` with the runner's ``kv_ready``, woken by ``on_kv_ready``)
    takes ``ready`` first and it completes before ``late``'s deadline; ``late`` fails about
    one ``recv_timeout`` after it was queued, not after ``ready``'s turn, nor twice."""
    ns = f"fullpick{os.getpid()}"
    caches = fake_cpu_caches(2, seed=5)
    with send_cfg_kv(ns, caches, {"r-1": request_plan(1)}) as sender:
        runner = DiffusionRunner(_dit_stage(ns))
        wake = threading.Event()
        runner.on_kv_ready(wake.set)
        late = DiffusionRequest("late", "never-sent", 0, {})
        ready = DiffusionRequest("ready", "r-1", 0, sender.get_sender_info("r-1"))
        queue = [late, ready]
        finished: dict[str, tuple[float, Any]] = {}
        try:
            t0 = time.monotonic()
            for req in queue:  # queued: the stage holds their KV and prefetches it
                runner.hold_kv(req)
            end = t0 + 4 * RECV_TIMEOUT + 30
            while queue and time.monotonic() < end:  # the stage's worker loop
                picked, _ = select_batch(queue, runner.max_batch_size, runner.steps_of, ready=runner.kv_ready)
                if not picked:
                    wake.wait(1.0)  # nothing ready: until a prefetch finished
                    wake.clear()
                    continue
                batch = [queue.pop(i) for i in reversed(picked)]
                for req in batch:
                    runner.release_kv(req)
                for req, out in zip(batch, runner.execute_batch(batch), strict=True):
                    finished[req.request_id] = (time.monotonic() - t0, out)
        finally:
            runner.close()
    assert set(finished) == {"late", "ready"}, finished
    (t_ready, out_ready), (t_late, out_late) = finished["ready"], finished["late"]
    assert not isinstance(out_ready, Exception), out_ready
    assert isinstance(out_late, TransferTimeout), out_late
    assert t_ready < RECV_TIMEOUT * 0.9 < t_late, finished  # ready went first, before late's deadline
    assert t_late < 2 * RECV_TIMEOUT, finished
    assert _dit_leftovers(ns) == []


@pytest.mark.timeout(120)
def test_the_diffusion_stage_serves_a_ready_request_before_a_late_one() -> None:
    """The same order through the stage's real engine (its worker thread, in-process):
    ``ready`` is done before ``late``'s deadline, ``late`` fails about one ``recv_timeout``
    after it was submitted."""
    from vllm_kvbridge.pipeline import messages as m
    from vllm_kvbridge.pipeline.engines import build_engine

    ns = f"fulleng{os.getpid()}"
    with send_cfg_kv(ns, fake_cpu_caches(2, seed=5), {"r-1": request_plan(1)}) as sender:
        engine = build_engine(_dit_stage(ns))
        seen: list[tuple[float, Any]] = []
        try:
            t0 = time.monotonic()
            engine.submit(m.Submit("late", upstream=[m.Upstream(0, "never-sent", {})]))
            engine.submit(m.Submit("ready", upstream=[m.Upstream(0, "r-1", sender.get_sender_info("r-1"))]))
            end = t0 + 4 * RECV_TIMEOUT + 30
            while len(seen) < 2 and time.monotonic() < end:
                seen += [(time.monotonic() - t0, x) for x in engine.step()]
                time.sleep(0.02)
        finally:
            engine.close()
    got = [(type(x).__name__, x.request_id) for _, x in seen]
    assert got == [("StageDone", "ready"), ("RequestFailed", "late")], seen
    (t_ready, _), (t_late, failed) = seen
    assert "TransferTimeout" in failed.error, failed
    assert t_ready < RECV_TIMEOUT * 0.9 < t_late < 2 * RECV_TIMEOUT, seen
    assert _dit_leftovers(ns) == []
