"""Issue 15 item 2: a full edge is waited out, never dropped (real connectors and threads).

A sender that holds its limit of unread bytes refuses a put with ``PutResult.full``; the
KV send waits for room (no retry used up) until ``send_timeout``, then fails naming the
limit. While gathered KV waits for its puts beyond ``max_send_queue_bytes``, the worker's
sender holds finished requests' KV in the engine's blocks (not gathered, not released)
and gathers it, in order, once the queue drains. Every state a test looks at is held by
the edge being full (nobody reads), never by a sleep.

A connector that lends device memory (``device_resident``: CUDA IPC; here a shm connector
that says so, see ``kv_sender_fixtures.DeviceResidentShm``) and is full at the gather never
sends the KV through a host buffer: a finished request's KV stays in its blocks (held) and
is gathered straight into the connector's memory once there is room, failing only past
``send_timeout``; a running request's send (blocks vLLM frees without asking) waits in
the staging pool, copied off the model thread.
"""

from __future__ import annotations

import time

import pytest
import torch
from kv_sender_fixtures import DeviceResidentShm as _DeviceShm
from kv_sender_fixtures import GatedShm as _GatedShm
from kv_sender_fixtures import held_until_it_fails
from kv_sender_fixtures import read_exact as _read_exact
from kv_sender_fixtures import receiver as _receiver
from kv_sender_fixtures import spec as _spec
from kv_sender_fixtures import status as _status
from kv_sender_fixtures import wait as _wait
from kv_sender_fixtures import worker as _worker
from runner_fixtures import shm_entries, shm_namespace

from vllm_kvbridge.connectors.put_retry import put_with_retry
from vllm_kvbridge.connectors.zmq_p2p import ZmqConnector
from vllm_kvbridge.wire.staging import MIN_BUFFER

pytestmark = pytest.mark.forked


def _one_segment(ns: str) -> int:
    """Segment bytes one request's KV takes on a shm edge (measured by a real put)."""
    sender = _worker(ns, max_held_bytes=1 << 40)
    try:
        sender.send([_spec("probe")])
        _wait(lambda: sender.status(["probe"])["probe"]["kv"] == "done")
        held = sender.manager.connector.health()["held_bytes"]
        sender.discard(["probe"])
    finally:
        sender.shutdown()
    assert held > 0
    return held


def test_a_put_into_a_full_edge_waits_for_room_and_then_lands() -> None:
    """The connector says ``full`` (not a failure) at its limit; the put with retry waits,
    using up no retry, and lands as soon as the receiver read what filled the edge."""
    with ZmqConnector({"max_inflight_bytes": 3000}) as sender, ZmqConnector({}) as receiver:
        first = sender.put(0, 1, "a", {"x": torch.arange(300, dtype=torch.int64)})  # 2400 bytes
        assert first.ok
        refused = sender.put(0, 1, "b", {"x": torch.arange(300, dtype=torch.int64)})
        assert refused.full and not refused.ok and "max_inflight_bytes=3000" in refused.error
        never = sender.put(0, 1, "c", {"x": torch.arange(400, dtype=torch.int64)})  # over the limit alone
        assert not never.ok and not never.full, "a payload that can never fit is a failure"
        assert sender.health()["put_full"] == 1

        calls = []

        def put_b():
            calls.append(1)
            if len(calls) == 3:  # the edge has been full twice: now the receiver reads "a"
                got = receiver.get(0, 1, "a", first.metadata, deadline=time.monotonic() + 5)
                assert torch.equal(got["x"], torch.arange(300, dtype=torch.int64))
            return sender.put(0, 1, "b", {"x": torch.arange(300, dtype=torch.int64)})

        outcome = put_with_retry(put_b, retries=0, backoff=lambda i: 0.0, send_timeout_s=10)
        assert outcome.ok and outcome.retries == 0 and outcome.attempts == 3 and outcome.full_wait_s > 0

        # Nobody reads: the wait ends at send_timeout, naming the limit and the wait.
        timed = put_with_retry(
            lambda: sender.put(0, 1, "d", {"x": torch.arange(300, dtype=torch.int64)}),
            retries=5,
            backoff=lambda i: 0.0,
            send_timeout_s=0.3,
        )
        assert not timed.ok and timed.retries == 0
        assert "edge full for" in timed.error and "max_inflight_bytes=3000" in timed.error
        assert timed.full_wait_s >= 0.3


def test_a_kv_send_into_a_full_edge_waits_then_is_delivered() -> None:
    """Two requests, room for one: the second's put waits (pending, never failed, never
    dropped) until the first is read, then lands and is read bit-exact."""
    ns = shm_namespace("bpwait")
    one = _one_segment(ns)
    sender = _worker(ns, max_held_bytes=one + one // 2)
    try:
        sender.send([_spec("A")])
        _wait(lambda: _status(sender, "A") == "done")
        sender.send([_spec("B")])
        # B found the edge full at its gather (no segment to gather into: it went to a host
        # buffer) and again at the put from that buffer, which now waits for room.
        _wait(lambda: sender.manager.connector.health()["put_full"] >= 2)
        assert _status(sender, "B") == "pending" and sender.manager.queued_send_bytes() > 0
        with _receiver(ns) as receiver:
            _read_exact(receiver, "A")
            _wait(lambda: _status(sender, "B") == "done")
            _read_exact(receiver, "B")
        assert sender.manager.metrics.health()["send"]["full_waits"] == 1
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []


def test_a_kv_send_that_finds_no_room_in_time_fails_naming_the_limit() -> None:
    ns = shm_namespace("bptimeout")
    one = _one_segment(ns)
    sender = _worker(ns, max_held_bytes=one + one // 2, send_timeout=0.3)
    try:
        sender.send([_spec("A")])
        _wait(lambda: _status(sender, "A") == "done")
        sender.send([_spec("B")])
        _wait(lambda: _status(sender, "B") != "pending")
        why = _status(sender, "B")
        assert why.startswith("failed") and "edge full for" in why and "max_held_bytes=" in why, why
        sender.discard(["A"])  # A's request failed elsewhere: nothing stays behind
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []


def test_finished_requests_keep_their_kv_in_the_engine_while_the_send_queue_is_full() -> None:
    """Over ``max_send_queue_bytes`` a finished request's blocks are held, not gathered; they
    are gathered (and released) in order once the queue drains; a held one withdrawn, or
    held past ``send_timeout``, fails and gives its blocks back."""
    ns = shm_namespace("bphold")
    one = _one_segment(ns)
    sender = _worker(ns, max_held_bytes=one + one // 2, max_send_queue_bytes=1)
    try:
        sender.send([_spec("A")])
        assert sender.take_released() == {"e-A"}  # an empty queue always takes one
        _wait(lambda: _status(sender, "A") == "done")
        sender.send([_spec("B")])  # queue empty again: gathered, its put waits for room
        assert sender.take_released() == {"e-B"}
        _wait(lambda: sender.manager.connector.health()["put_full"] >= 1)
        sender.send([_spec("C"), _spec("D")])
        assert sender.held() == 2 and sender.take_released() == set()
        assert _status(sender, "C") == _status(sender, "D") == "pending"

        sender.discard(["D"])  # D's request failed elsewhere: its blocks go back ungathered
        assert sender.held() == 1 and sender.take_released() == {"e-D"}
        assert _status(sender, "D") == "failed: withdrawn before its KV was gathered"

        with _receiver(ns) as receiver:
            _read_exact(receiver, "A")
            _wait(lambda: _status(sender, "B") == "done" and sender.manager.queued_send_bytes() == 0)
            sender.send([])  # the next engine step gathers C
            assert sender.held() == 0 and sender.take_released() == {"e-C"}
            _read_exact(receiver, "B")
            _wait(lambda: _status(sender, "C") == "done")
            _read_exact(receiver, "C")
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []


def test_a_send_held_past_send_timeout_fails_and_releases_its_blocks() -> None:
    """The link is slower than the engine (a put that does not return): the next finished
    request is held, and fails once held for ``send_timeout``; the slow one still lands."""
    ns = shm_namespace("bpheldout")
    _GatedShm.gate.clear()
    sender = _worker(ns, connector=_GatedShm.name, max_send_queue_bytes=1, send_timeout=0.5)
    try:
        sender.send([_spec("A")])  # its put waits at the gate
        assert sender.take_released() == {"e-A"}
        _wait(lambda: sender.manager.queued_send_bytes() > 0)
        sender.send([_spec("C")])
        assert sender.held() == 1 and sender.take_released() == set()
        why = held_until_it_fails(sender, ns, "A", "C")
        assert why.startswith("failed: KV held") and "max_send_queue_bytes=1" in why, why
    finally:
        _GatedShm.gate.set()
        sender.shutdown()
    assert shm_entries(ns) == []


def _device_worker(ns: str, **kv):
    """A sender on a device-resident edge that holds one request's KV (A's, read by nobody),
    with a staging pool as on a GPU stage (``staging_bytes`` defaults to one there)."""
    one = _one_segment(ns)
    kv.setdefault("staging_bytes", 8 * MIN_BUFFER)
    sender = _worker(ns, connector=_DeviceShm.name, max_held_bytes=one + one // 2, **kv)
    sender.send([_spec("A")])
    assert sender.take_released() == {"e-A"}
    _wait(lambda: _status(sender, "A") == "done")
    return sender


def test_a_full_device_budget_keeps_the_kv_in_its_blocks_and_sends_it_once_room_frees() -> None:
    """Issue 16 item 4: no room in the device budget at the gather. The finished request is
    held (blocks not given back), nothing is copied anywhere (no host buffer, no queued
    put, no staging), and the first engine step after a receiver freed room gathers it
    straight into the connector's memory."""
    ns = shm_namespace("bpdevfull")
    sender = _device_worker(ns)
    try:
        sender.send([_spec("B")])
        for _ in range(5):  # engine steps while the budget stays full
            sender.send([], idle=True)
            assert sender.held() == 1 and sender.take_released() == set()
        assert _status(sender, "B") == "pending"
        assert sender.manager.queued_send_bytes() == 0 and sender.pending() == 0
        staging = sender.manager.staging_stats()
        assert staging["peak"] == 0 and staging["bypassed"] == 0 and staging["reserve_full"] >= 6, staging
        with _receiver(ns) as receiver:
            _read_exact(receiver, "A")
            released: set[str] = set()
            _wait(lambda: (sender.send([]), released.update(sender.take_released()))[0] or "e-B" in released)
            assert released == {"e-B"} and sender.held() == 0
            _wait(lambda: _status(sender, "B") == "done")
            _read_exact(receiver, "B")
        assert sender.manager.staging_stats()["peak"] == 0  # straight into the connector's memory
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []


def test_a_device_budget_that_stays_full_fails_the_held_request_after_send_timeout() -> None:
    ns = shm_namespace("bpdevtimeout")
    sender = _device_worker(ns, send_timeout=0.5)
    try:
        sender.send([_spec("B")])
        assert sender.held() == 1 and sender.take_released() == set()
        _wait(lambda: (sender.send([]), sender.held() == 0)[1], timeout=5)  # engine steps
        assert sender.take_released() == {"e-B"}  # failed: its blocks go back ungathered
        why = _status(sender, "B")
        assert why.startswith("failed: KV held") and "send_timeout 0.5 s" in why, why
        assert "max_held_bytes=" in why, why  # the connector's own words for why it was full
        assert sender.manager.queued_send_bytes() == 0
        sender.discard(["A"])  # A's request failed elsewhere: nothing stays behind
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []


def test_a_running_requests_send_into_a_full_device_budget_waits_in_the_staging_pool() -> None:
    """A running request's blocks cannot be held (vLLM frees them without asking): its KV is
    staged (off the model thread on CUDA) and its put waits for room from the pool, never
    from a host buffer filled by a blocking copy on the model thread."""
    ns = shm_namespace("bpdevrun")
    sender = _device_worker(ns)
    try:
        sender.send([_spec("B", release=False)])
        assert sender.held() == 0
        # Full at the gather, and again at the publish out of the pool, which now waits.
        _wait(lambda: sender.manager.connector.health()["put_full"] >= 2)
        staging = sender.manager.staging_stats()
        assert staging["in_use"] > 0 and staging["bypassed"] == 0, staging
        assert _status(sender, "B") == "pending"
        with _receiver(ns) as receiver:
            _read_exact(receiver, "A")
            _wait(lambda: _status(sender, "B") == "done")
            _read_exact(receiver, "B")
        assert sender.manager.staging_stats()["in_use"] == 0
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []
