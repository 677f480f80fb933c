"""Payload flows without vLLM: real shared-memory connectors, real background threads."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from runner_fixtures import shm_entries, shm_namespace

from vllm_kvbridge.connectors.registry import create_connector, register_connector
from vllm_kvbridge.errors import ConfigError, TransferCorrupt, TransferError, TransferTimeout
from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin
from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
from vllm_kvbridge.runner.payload_stream import (
    PayloadAborted,
    PayloadSender,
    make_envelope,
    merge_payloads,
)

pytestmark = pytest.mark.forked


@pytest.fixture
def edge():
    ns = shm_namespace("ps")
    out = create_connector("SharedMemoryConnector", {"namespace": ns})
    inp = create_connector("SharedMemoryConnector", {"namespace": ns})
    yield ns, out, inp
    out.close()
    inp.close()
    assert shm_entries(ns) == []


def _wait(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met")


def test_merge_rule_concat_extend_replace() -> None:
    a = {"h": torch.ones(2, 3), "ids": [1], "step": 1, "r": torch.zeros(1)}
    b = {"h": torch.zeros(1, 3), "ids": [2, 3], "step": 2, "r": torch.ones(1)}
    got = merge_payloads([a, b], replace_keys=["r"])
    assert torch.equal(got["h"], torch.cat([a["h"], b["h"]]))
    assert got["ids"] == [1, 2, 3] and got["step"] == 2 and torch.equal(got["r"], torch.ones(1))


def test_async_chunks_arrive_in_order_and_concatenate_to_full(edge) -> None:
    _, out, inp = edge
    sender = PayloadSender(out, 0, 1)
    chunks_rx = PayloadReceiver(inp, 0, 1, mode="async_chunk", stall_timeout_s=5)
    parts = [{"h": torch.randn(3, 4), "ids": torch.arange(i, i + 3)} for i in range(5)]
    try:
        chunks_rx.expect("r1")
        for p in parts[:-1]:
            sender.send_chunk("r1", p)
        sender.send_chunk("r1", parts[-1], final=True)
        seen = list(chunks_rx.iter_chunks("r1", timeout=10))
        assert len(seen) == 5
        for got, want in zip(seen, parts, strict=True):
            assert torch.equal(got["h"], want["h"]) and torch.equal(got["ids"], want["ids"])
        _wait(lambda: sender.status("r1") == "done")
        sender.forget("r1")
        assert sender.tracked() == set() and chunks_rx.pending() == set()
    finally:
        sender.close()
        chunks_rx.close()


def test_full_payload_and_result_merge(edge) -> None:
    _, out, inp = edge
    sender = PayloadSender(out, 0, 1)
    rx = PayloadReceiver(inp, 0, 1, mode="full", recv_timeout_s=5)
    try:
        payload = {"h": torch.randn(7, 4), "ids": torch.arange(7)}
        rx.expect("r2")
        sender.send_full("r2", payload)
        got = rx.result("r2", timeout=10)
        assert torch.equal(got["h"], payload["h"]) and torch.equal(got["ids"], payload["ids"])
        with pytest.raises(TransferError, match="already finished"):
            sender.send_full("r2", payload)
    finally:
        sender.close()
        rx.close()


def test_stalled_stream_fails_after_the_stall_timeout(edge) -> None:
    _, out, inp = edge
    sender = PayloadSender(out, 0, 1)
    rx = PayloadReceiver(inp, 0, 1, mode="async_chunk", stall_timeout_s=0.5, recv_timeout_s=5)
    try:
        rx.expect("r3")
        sender.send_chunk("r3", {"h": torch.ones(1)})
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"chunk 1 .*stalled"):
            rx.result("r3", timeout=10)
        assert 0.4 < time.monotonic() - start < 5
        assert rx.pending() == set()
    finally:
        sender.close()
        rx.close()


def test_full_payload_that_never_comes_times_out(edge) -> None:
    _, _, inp = edge
    rx = PayloadReceiver(inp, 0, 1, mode="full", recv_timeout_s=0.3)
    try:
        rx.expect("never")
        with pytest.raises(TransferTimeout, match=r"did not arrive within 0\.3 s"):
            rx.result("never", timeout=10)
    finally:
        rx.close()


def test_abort_reaches_the_receiver_and_leaves_no_key(edge) -> None:
    ns, out, inp = edge
    sender = PayloadSender(out, 0, 1)
    rx = PayloadReceiver(inp, 0, 1, mode="async_chunk", stall_timeout_s=5)
    try:
        rx.expect("r4")
        sender.send_chunk("r4", {"h": torch.ones(2)})
        sender.abort("r4", "user cancelled", chunked=True)
        with pytest.raises(PayloadAborted, match="user cancelled"):
            rx.result("r4", timeout=10)
        _wait(lambda: sender.in_flight("r4") == 0)
        assert sender.status("r4").startswith("failed")
        sender.forget("r4")
        assert [e for e in shm_entries(ns) if ".k." in e] == []
    finally:
        sender.close()
        rx.close()


def test_failed_put_is_reported_and_the_receiver_is_told(edge) -> None:
    _, out, inp = edge
    sender = PayloadSender(out, 0, 1, retries=1, backoff_s=0.01)
    rx = PayloadReceiver(inp, 0, 1, mode="full", recv_timeout_s=5)
    try:
        rx.expect("r5")
        sender.send_full("r5", {"bad": object()})  # the codec refuses it: the put fails
        _wait(lambda: (sender.status("r5") or "").startswith("failed"))
        assert "after 2 failed attempts" in sender.status("r5")
        with pytest.raises(PayloadAborted, match="after 2 failed attempts"):
            rx.result("r5", timeout=10)
    finally:
        sender.close()
        rx.close()


def test_corrupt_and_mismatched_envelopes_fail_cleanly(edge) -> None:
    _, out, inp = edge
    rx = PayloadReceiver(inp, 0, 1, mode="full", recv_timeout_s=5)
    try:
        rx.expect("r6")
        out.put(0, 1, rx.key("r6", None), make_envelope("full", "someone-else", {"x": 1}))
        with pytest.raises(TransferCorrupt, match="envelope is for request 'someone-else'"):
            rx.result("r6", timeout=10)
        rx.expect("r7")
        out.put(0, 1, rx.key("r7", None), {"not": "an envelope"})
        with pytest.raises(TransferCorrupt, match="not a kvbridge payload envelope"):
            rx.result("r7", timeout=10)
    finally:
        rx.close()


def test_cancel_and_close_release_waiters(edge) -> None:
    _, _, inp = edge
    rx = PayloadReceiver(inp, 0, 1, mode="async_chunk")
    rx.expect("a")
    assert rx.cancel("a") and not rx.cancel("a")
    with pytest.raises(TransferError, match="not expected"):
        rx.result("a", timeout=1)
    rx.expect("b")
    rx.close()
    with pytest.raises(TransferError):
        rx.expect("c")
    assert not rx._thread.is_alive()


def test_receiver_rejects_bad_settings(edge) -> None:
    _, _, inp = edge
    with pytest.raises(ConfigError, match="mode"):
        PayloadReceiver(inp, 0, 1, mode="chunky")
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        PayloadReceiver(inp, 0, 1, stall_timeout_s=0)


class _Host(KVBridgeModelRunnerMixin):
    """A non-vLLM runner: only the facade, no host hooks (payload sender and receiver)."""


def _settings(ns: str, mode: str, direction: str) -> dict:
    edge = {"mode": mode, "connector": "SharedMemoryConnector", "connector_config": {"namespace": ns}}
    if direction == "out":
        return {
            "stage_id": 0,
            "payload": {"outputs": [{"to_stage": 1, "chunk_size": 2, **edge}], "replace_keys": ["meta"]},
        }
    return {
        "stage_id": 1,
        "payload": {"inputs": [{"from_stage": 0, "stall_timeout_s": 5, **edge}], "replace_keys": ["meta"]},
    }


@pytest.mark.parametrize("mode", ["full", "async_chunk"])
def test_facade_flows_between_two_runners(mode: str) -> None:
    ns = shm_namespace("fc" + mode[0])
    producer, consumer = _Host(), _Host()
    producer.kvbridge_init(_settings(ns, mode, "out"))
    consumer.kvbridge_init(_settings(ns, mode, "in"))
    try:
        steps = [{"h": torch.randn(n, 4), "meta": n} for n in (5, 1, 1, 1, 1)]
        consumer.kvbridge_expect_payload("req")
        producer.kvbridge_runtime.register("eng-req", "req", capture=True)
        for s in steps:
            producer.kvbridge_add_step_output("eng-req", s)
        producer.kvbridge_mark_finished("eng-req")
        got = consumer.kvbridge_get_payload("req", timeout=10)
        assert torch.equal(got["h"], torch.cat([s["h"] for s in steps])) and got["meta"] == 1
        _wait(lambda: producer.kvbridge_debug_state()["requests"] == [])
        assert producer.kvbridge_transfer_status(["req"])["req"]["payload"] == "done"
        assert producer.kvbridge_debug_state()["payload_tracked"] == {"1": []}
    finally:
        producer.kvbridge_shutdown()
        consumer.kvbridge_shutdown()
    assert producer.kvbridge_payloads.threads_alive() == 0
    assert shm_entries(ns) == []


def test_facade_abort_cleans_up_and_fails_the_consumer() -> None:
    ns = shm_namespace("fab")
    producer, consumer = _Host(), _Host()
    producer.kvbridge_init(_settings(ns, "async_chunk", "out"))
    consumer.kvbridge_init(_settings(ns, "async_chunk", "in"))
    try:
        consumer.kvbridge_expect_payload("req")
        producer.kvbridge_runtime.register("e", "req", capture=True)
        for _ in range(3):
            producer.kvbridge_add_step_output("e", {"h": torch.ones(1, 2)})
        producer.kvbridge_mark_finished("e", aborted=True)
        with pytest.raises(PayloadAborted):
            consumer.kvbridge_get_payload("req", timeout=10)
        _wait(lambda: producer.kvbridge_debug_state()["requests"] == [])
        state = producer.kvbridge_debug_state()
        assert state["accumulators"] == [] and state["payload_tracked"] == {"1": []}
        assert producer.kvbridge_transfer_status(["req"])["req"]["payload"] == "aborted"
        assert [e for e in shm_entries(ns) if ".k." in e] == []
    finally:
        producer.kvbridge_shutdown()
        consumer.kvbridge_shutdown()


def test_facade_without_init_or_edges_gives_clear_errors() -> None:
    host = _Host()
    with pytest.raises(ConfigError, match="kvbridge_init"):
        host.kvbridge_runtime  # noqa: B018
    host.kvbridge_init({"stage_id": 3})
    with pytest.raises(ConfigError, match="no payload input edges"):
        host.kvbridge_expect_payload("x")
    assert host.kvbridge_runtime.kv_manager is None  # no kv_transfer settings: nothing to receive
    host.kvbridge_shutdown()


def test_async_chunks_count_generated_tokens_not_engine_steps() -> None:
    """Issue 11, case 14: ``chunk_size`` is in tokens (schema, docs); chunked-prefill steps
    generate none and speculative steps several, so counting steps made other chunks."""
    ns = shm_namespace("ftok")
    producer, consumer = _Host(), _Host()
    producer.kvbridge_init(_settings(ns, "async_chunk", "out"))  # chunk_size 2
    consumer.kvbridge_init(_settings(ns, "async_chunk", "in"))
    try:
        receiver = consumer.kvbridge_payloads.receiver()
        receiver.expect("req")
        producer.kvbridge_runtime.register("e", "req", capture=True)
        # Two partial-prefill steps (no token), then one token per step, then a 3-token step.
        tokens = [0, 0, 1, 1, 1, 3, 1]
        for i, n in enumerate(tokens):
            producer.kvbridge_add_step_output("e", {"t": torch.full((n,), i)}, num_tokens=n)
        producer.kvbridge_mark_finished("e")
        chunks = [c["t"].tolist() for c in receiver.iter_chunks("req", timeout=10)]
        assert chunks == [[2, 3], [4, 5, 5, 5], [6]]
    finally:
        producer.kvbridge_shutdown()
        consumer.kvbridge_shutdown()
    assert shm_entries(ns) == []


class _GateOneRequest:
    """Wraps a real connector: puts of keys containing ``marker`` wait for ``gate``."""

    def __init__(self, conn, marker: str) -> None:
        self.conn, self.marker = conn, marker
        self.gate = threading.Event()

    def put(self, from_stage, to_stage, key, payload):
        if self.marker in key and not self.gate.wait(30):
            raise TimeoutError("gate never opened")
        return self.conn.put(from_stage, to_stage, key, payload)


def test_a_slow_request_does_not_hold_up_the_others_on_its_edge(edge) -> None:
    """Issue 11, case 8: one FIFO thread per edge made every request wait behind one slow
    put (and its sleeping retries), tripping their stall timeouts."""
    _, out, inp = edge
    gated = _GateOneRequest(out, "islow")
    sender = PayloadSender(gated, 0, 1)
    chunks_rx = PayloadReceiver(inp, 0, 1, mode="async_chunk", recv_timeout_s=20, stall_timeout_s=20)
    try:
        for rid in ("slow", "fast"):
            chunks_rx.expect(rid)
        for i in range(4):  # interleaved, as a batch's steps would be
            for rid in ("slow", "fast"):
                sender.send_chunk(rid, {"i": torch.tensor([i])}, final=i == 3)
        # The fast request arrives whole, in order, while the slow one's first put waits.
        assert [c["i"].item() for c in chunks_rx.iter_chunks("fast", timeout=10)] == [0, 1, 2, 3]
        assert sender.status("slow") == "pending" and sender.in_flight("slow") == 4
        gated.gate.set()
        assert [c["i"].item() for c in chunks_rx.iter_chunks("slow", timeout=10)] == [0, 1, 2, 3]
        _wait(lambda: sender.status("slow") == sender.status("fast") == "done")
    finally:
        gated.gate.set()
        sender.close()
        chunks_rx.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvbridge-payload-send")]


def _connector_that_cannot_start(config):
    raise TransferError("injected: the store is unreachable")


def test_a_connector_error_in_the_step_fails_the_requests_never_the_engine() -> None:
    """Issue 11, case 9: the connector step runs inside vLLM's ``wait_for_save``; an error
    there (a connector that cannot be created when an abort needs it, a send that cannot
    start) took the engine down. Now the requests fail with the reason; the step returns."""
    register_connector("CannotStart", _connector_that_cannot_start, replace=True)
    host = _Host()
    edge = {"to_stage": 1, "mode": "async_chunk", "connector": "CannotStart"}
    host.kvbridge_init({"stage_id": 0, "payload": {"outputs": [edge]}})
    try:
        host.kvbridge_runtime.register("e1", "r1", capture=True)
        host.kvbridge_add_step_output("e1", {"h": torch.ones(1, 2)})  # below chunk_size: no put
        host.kvbridge_connector_step({"e1": ("aborted", "r1")})  # must not raise
        status = host.kvbridge_transfer_status(["r1"])["r1"]
        assert status["payload"].startswith("failed") and "store is unreachable" in status["payload"]
        _wait(lambda: host.kvbridge_debug_state()["requests"] == [])
    finally:
        host.kvbridge_shutdown()


def test_connectors_are_created_at_start_not_on_the_model_thread() -> None:
    """Issue 11, case 9: a connector created on first use was set up on the model thread
    in the middle of serving (and failed there); ``kvbridge_payloads.connect()`` does it at start."""
    register_connector("CannotStart", _connector_that_cannot_start, replace=True)
    host = _Host()
    host.kvbridge_init({"stage_id": 0, "payload": {"outputs": [{"to_stage": 1, "connector": "CannotStart"}]}})
    try:
        with pytest.raises(TransferError, match="store is unreachable"):
            host.kvbridge_payloads.connect()
    finally:
        host.kvbridge_shutdown()
    ns = shm_namespace("fconn")
    host = _Host()
    host.kvbridge_init(_settings(ns, "full", "out"))
    try:
        host.kvbridge_payloads.connect()
        assert host.kvbridge_payloads.threads_alive() > 0  # the sender exists before any request
    finally:
        host.kvbridge_shutdown()
    assert shm_entries(ns) == []


def test_a_sender_reports_a_request_once_when_its_last_put_settled() -> None:
    """``on_settled`` (the runtime reaps and reports the request from there, issue 38):
    not after a chunk that is not the last, once after the final one, with its status."""
    ns = shm_namespace("settle")
    conn = create_connector("SharedMemoryConnector", {"namespace": ns})
    sender = PayloadSender(conn, 0, 1)
    settled: list[tuple[str, str | None]] = []
    event = threading.Event()
    sender.on_settled = lambda rid: (settled.append((rid, sender.status(rid))), event.set())
    try:
        sender.send_chunk("r", {"h": torch.ones(2)})
        give_up = time.monotonic() + 10
        while sender.in_flight("r") and time.monotonic() < give_up:
            time.sleep(0.01)
        assert not event.is_set()  # a chunk that is not the last settles nothing
        sender.send_chunk("r", {"h": torch.ones(2)}, final=True)
        assert event.wait(10)
        assert settled == [("r", "done")]
    finally:
        sender.close()
        conn.close()
