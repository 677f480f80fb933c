"""Transfer outcomes pushed by the workers (runner/outcomes.py) and the stage's verdict on a
finished request (pipeline/awaited_sends.py): real ZMQ sockets, no engine."""

from __future__ import annotations

import time

import zmq

from vllm_kvbridge.pipeline import awaited_sends
from vllm_kvbridge.pipeline.awaited_sends import AwaitedSends
from vllm_kvbridge.runner.outcomes import OutcomeInbox, OutcomePusher, TransferOutcome


def _deliver(sends: AwaitedSends, pusher: OutcomePusher, *outcomes: TransferOutcome) -> None:
    for outcome in outcomes:
        pusher.push(outcome)
    got = 0
    give_up = time.monotonic() + 10
    while got < len(outcomes) and time.monotonic() < give_up:
        before = sum(len(s.kv) + (s.payload is not None) for s in sends._sends.values())
        sends.take(0.5)
        got += sum(len(s.kv) + (s.payload is not None) for s in sends._sends.values()) - before


def _pair(workers: int = 1) -> tuple[AwaitedSends, OutcomePusher]:
    inbox = OutcomeInbox()
    return AwaitedSends(inbox, workers), OutcomePusher(inbox.address)


def _verdict(sends: AwaitedSends, rid: str = "r", *, age_s: float = 0.0, **kw):
    args = {"kv_owed": True, "payload_owed": False, "must_send_kv": False, **kw}
    return sends.verdict(rid, finished_at=time.time() - age_s, **args)


def test_a_kv_send_is_waited_for_while_pending_and_ready_with_its_sender_info_when_done() -> None:
    sends, pusher = _pair()
    try:
        assert _verdict(sends).state == "wait"  # owed, not started yet
        _deliver(sends, pusher, TransferOutcome("r", 0, "kv", "pending"))
        assert _verdict(sends, age_s=3600).state == "wait"  # started: its own deadlines bound it
        info = {"keys": {"k0": {"name": "n0"}}, "num_kv_heads": 2}
        _deliver(sends, pusher, TransferOutcome("r", 0, "kv", "done", info=info))
        verdict = _verdict(sends)
        assert verdict.state == "ready" and verdict.sender_info == info
    finally:
        pusher.close()
        sends.inbox.close()


def test_a_failed_send_fails_its_request_with_the_workers_reason() -> None:
    sends, pusher = _pair()
    try:
        _deliver(sends, pusher, TransferOutcome("r", 0, "kv", "failed", reason="put timed out: edge full"))
        verdict = _verdict(sends)
        assert verdict.state == "failed" and verdict.error == "failed: put timed out: edge full"
    finally:
        pusher.close()
        sends.inbox.close()


def test_an_owed_send_that_never_starts_fails_after_the_start_timeout() -> None:
    sends, pusher = _pair(workers=2)
    try:
        _deliver(sends, pusher, TransferOutcome("r", 0, "kv", "pending"))  # one worker of two
        late = awaited_sends.SEND_START_TIMEOUT_S + 1
        assert _verdict(sends).state == "wait"
        verdict = _verdict(sends, age_s=late)
        assert verdict.state == "failed" and "never started" in verdict.error
        payload = _verdict(sends, "p", age_s=late, kv_owed=False, payload_owed=True)
        assert payload.state == "failed" and "payload was owed but never started" in payload.error
    finally:
        pusher.close()
        sends.inbox.close()


def test_every_worker_must_settle_its_part_of_a_kv_send() -> None:
    """Each TP rank sends its heads: one rank done is not the request's KV done. The pusher
    stamps its process; two pushers stand for two worker processes here."""
    inbox = OutcomeInbox()
    sends = AwaitedSends(inbox, 2)
    first, second = OutcomePusher(inbox.address), OutcomePusher(inbox.address)
    second.pid = first.pid + 1
    try:
        _deliver(sends, first, TransferOutcome("r", 0, "kv", "done", info={"ranks": {"0": {"a": 1}}}))
        assert _verdict(sends).state == "wait"
        _deliver(sends, second, TransferOutcome("r", 1, "kv", "done", info={"ranks": {"1": {"b": 2}}}))
        verdict = _verdict(sends)
        assert verdict.state == "ready" and verdict.sender_info == {"ranks": {"0": {"a": 1}, "1": {"b": 2}}}
    finally:
        first.close()
        second.close()
        inbox.close()


def test_a_cfg_member_without_kv_fails_and_a_payload_is_waited_for() -> None:
    sends, pusher = _pair()
    try:
        verdict = _verdict(sends, kv_owed=False, must_send_kv=True)
        assert verdict.state == "failed" and "its KV was not sent" in verdict.error
        assert _verdict(sends, kv_owed=False, payload_owed=True).state == "wait"
        _deliver(sends, pusher, TransferOutcome("r", 0, "payload", "pending"))
        assert _verdict(sends, kv_owed=False, payload_owed=True).state == "wait"
        edge = {"1": {"namespace": "ns", "bell": "udp://127.0.0.1:1"}}
        _deliver(sends, pusher, TransferOutcome("r", 0, "payload", "done", info={"payload": edge}))
        verdict = _verdict(sends, kv_owed=False, payload_owed=True)
        assert verdict.state == "ready" and verdict.sender_info == {"payload": edge}
    finally:
        pusher.close()
        sends.inbox.close()


def test_the_inbox_drops_what_lacks_its_token_or_does_not_decode() -> None:
    inbox = OutcomeInbox()
    endpoint, _, token = inbox.address.partition("#")
    ctx = zmq.Context()
    stray = ctx.socket(zmq.PUSH)
    stray.connect(endpoint)
    good = OutcomePusher(inbox.address)
    try:
        stray.send_multipart([b"not-the-token", b"x"])
        stray.send_multipart([token.encode(), b"\xc1 not msgpack"])
        good.push(TransferOutcome("ok", 0, "kv", "done"))
        got: list[TransferOutcome] = []
        give_up = time.monotonic() + 10
        while not got and time.monotonic() < give_up:
            got = inbox.take(0.5)
        assert [o.transfer_id for o in got] == ["ok"] and got[0].pid == good.pid
    finally:
        stray.close(0)
        ctx.term()
        good.close()
        inbox.close()


def test_a_worker_without_an_inbox_pushes_nothing() -> None:
    OutcomePusher(None).push(TransferOutcome("r", 0, "kv", "done"))  # no socket, no error
