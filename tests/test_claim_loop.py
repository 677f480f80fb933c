"""The pull connectors' one claim-until-deadline loop (connectors/claim_loop.py) and the
control channel's claim over it (te_control.ControlClient.claim).

Real sockets and a real ControlServer for the claim; the loop alone with plain attempts.
Waits are on real conditions (the server saw the request), never a fixed count of tries."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import zmq

from vllm_kvbridge.connectors import te_control as ctl
from vllm_kvbridge.connectors.claim_loop import MISSING, Retry, claim_until_deadline, hold_seconds
from vllm_kvbridge.errors import ConnectorClosed, TransferError, TransferRefused, TransferTimeout


def _never_closed() -> None:
    pass


def test_without_a_deadline_one_attempt_and_missing_is_none() -> None:
    calls: list[tuple[float, float]] = []

    def attempt(hold: float, wait_until: float):  # type: ignore[no-untyped-def]
        calls.append((hold, wait_until - time.monotonic()))
        return MISSING

    got = claim_until_deadline(
        attempt, None, not_there="x", check_open=_never_closed, request_timeout_s=5, long_poll_s=1
    )
    assert got is None and len(calls) == 1
    hold, wait = calls[0]
    assert hold == 0 and 4 < wait <= 5  # no hold; the answer is waited for request_timeout_s


def test_with_a_deadline_it_backs_off_and_times_out_with_the_connectors_words() -> None:
    tries: list[float] = []

    def attempt(hold: float, wait_until: float):  # type: ignore[no-untyped-def]
        tries.append(time.monotonic())
        return MISSING

    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="not there in time"):
        claim_until_deadline(attempt, start + 0.3, not_there="not there in time", check_open=_never_closed)
    assert time.monotonic() - start >= 0.3
    # Backing off (1 ms doubling to 20 ms), not spinning: a few tries, each gap at most ~20 ms.
    assert 2 <= len(tries) < 100


def test_an_attempt_that_claims_ends_the_loop_with_its_result() -> None:
    answers = iter([MISSING, MISSING, "payload"])
    got = claim_until_deadline(
        lambda hold, until: next(answers),
        time.monotonic() + 30,
        not_there="x",
        check_open=_never_closed,
    )
    assert got == "payload"


def test_a_retry_that_says_always_is_retried_without_a_deadline_at_least_floor_apart() -> None:
    tries: list[float] = []

    def attempt(hold: float, wait_until: float):  # type: ignore[no-untyped-def]
        tries.append(time.monotonic())
        return "done" if len(tries) == 3 else Retry(floor=0.05, cap=0.5, always=True)

    assert claim_until_deadline(attempt, None, not_there="x", check_open=_never_closed) == "done"
    assert all(b - a >= 0.05 for a, b in itertools.pairwise(tries))


def test_a_closed_connector_ends_the_loop() -> None:
    closed = threading.Event()

    def check_open() -> None:
        if closed.is_set():
            raise ConnectorClosed("closed")

    def attempt(hold: float, wait_until: float):  # type: ignore[no-untyped-def]
        closed.set()  # closed while it waited
        return MISSING

    with pytest.raises(ConnectorClosed):
        claim_until_deadline(attempt, time.monotonic() + 30, not_there="x", check_open=check_open)


def test_the_hold_follows_the_deadline() -> None:
    assert hold_seconds(None, 1.0) == 0.0
    assert hold_seconds(time.monotonic(), 1.0) == 0.0  # no time left to hold
    assert hold_seconds(time.monotonic() + 60, 1.0) == 1.0
    assert 0.2 < hold_seconds(time.monotonic() + 0.3, 1.0) < 0.3  # ends before the deadline


# -- ControlClient.claim against a real ControlServer ------------------------------------
class _Sender:
    """A ControlServer over a dict: CLAIM takes the key, as the connectors' handlers do."""

    def __init__(self) -> None:
        self.keys: dict[bytes, list[bytes]] = {}
        self.ctx = zmq.Context()
        self.server = ctl.ControlServer(self.ctx, "127.0.0.1", 0, "127.0.0.1", self.answer)
        self.server.start(lambda: None, 0.05)
        self.client = ctl.ControlClient(self.ctx, lambda: False)

    def answer(self, request: list[bytes]) -> list[bytes]:
        return self.keys.pop(request[1], None) or [ctl.MISSING]

    def put(self, key: bytes, answer: list[bytes]) -> None:
        self.keys[key] = answer
        self.server.key_put(key.decode())

    def claim(self, key: str, deadline: float | None, **kw):  # type: ignore[no-untyped-def]
        request = [ctl.CLAIM, key.encode(), b"r" * 8, ctl.U64.pack(100)]
        return self.client.claim(
            self.server.endpoint,
            key,
            request,
            deadline,
            fields=2,
            request_timeout_s=5,
            max_payload_bytes=100,
            check_open=_never_closed,
            **kw,
        )

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.ctx.term()


@pytest.fixture
def sender(monkeypatch):  # type: ignore[no-untyped-def]
    # Holds as long as the tests ask: a put that a busy machine delays past one second must
    # still find its claim held (one request, whoever is slow).
    monkeypatch.setattr(ctl, "LONG_POLL_S", 30.0)
    s = _Sender()
    yield s
    s.close()


def test_a_claim_waiting_before_the_put_is_one_held_request_answered_by_the_put(sender) -> None:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(sender.claim("k", time.monotonic() + 30)))
    thread.start()
    give_up = time.monotonic() + 10
    while sender.server.requests < 1 and time.monotonic() < give_up:
        time.sleep(0.001)  # the claim reached the server (and is held)
    sender.put(b"k", [ctl.OK, b"a", b"b"])
    thread.join(10)
    assert out == [[b"a", b"b"]] and sender.server.requests == 1


def test_a_claim_without_a_deadline_asks_once(sender) -> None:
    assert sender.claim("none", None) is None and sender.server.requests == 1


def test_an_answer_over_the_limit_is_refused_and_a_strange_one_fails(sender) -> None:
    sender.put(b"big", [ctl.TOOBIG, ctl.U64.pack(1000)])
    with pytest.raises(TransferRefused, match="1000 bytes, over max_payload_bytes=100"):
        sender.claim("big", None)
    sender.put(b"odd", [ctl.OK, b"only one field"])
    with pytest.raises(TransferError, match="answered"):
        sender.claim("odd", None)


def test_an_answer_this_receiver_consumed_already_counts_as_missing(sender) -> None:
    sender.put(b"k", [ctl.OK, b"old", b"claim"])
    assert sender.claim("k", None, taken=lambda answer: answer[2] == b"claim") is None
    sender.put(b"k", [ctl.OK, b"new", b"other"])
    assert sender.claim("k", None, taken=lambda answer: answer[2] == b"claim") == [b"new", b"other"]
