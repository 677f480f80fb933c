"""The one-sided connectors' control channel (connectors/te_control.py): its long poll.

A claim with ``hold_ms`` that finds nothing is held until the key is put
(``ControlServer.key_put``) or the hold ends (MISSING); past ``MAX_HELD`` held requests a
claim is answered MISSING at once. Real sockets, a handler over a dict."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from vllm_kvbridge.connectors import create_connector
from vllm_kvbridge.connectors import te_control as ctl


class _Sender:
    def __init__(self) -> None:
        self.keys: dict[bytes, bytes] = {}
        self.ctx = zmq.Context()
        self.server = ctl.ControlServer(self.ctx, "127.0.0.1", 0, "127.0.0.1", self.answer)
        self.server.start(lambda: None, 0.05)
        self.client = ctl.ControlClient(self.ctx, lambda: False)

    def answer(self, request: list[bytes]) -> list[bytes]:
        value = self.keys.pop(request[1], None)  # a claim takes the key, as the connectors'
        return [ctl.OK, value] if value is not None else [ctl.MISSING]

    def claim(self, key: bytes, hold_ms: int | None) -> tuple[list[bytes], float]:
        frames = [ctl.CLAIM, key, b"r" * 8, ctl.U64.pack(1 << 20)]
        if hold_ms is not None:
            frames.append(ctl.U64.pack(hold_ms))
        start = time.monotonic()
        answer = self.client.request(self.server.endpoint, frames, time.monotonic() + 10)
        return answer, time.monotonic() - start

    def put(self, key: bytes, value: bytes) -> None:
        self.keys[key] = value
        self.server.key_put(key.decode())

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self.ctx.term()


@pytest.fixture
def sender(monkeypatch):
    # Holds as long as the tests ask (the server clamps them to LONG_POLL_S): a put that a
    # busy machine delays past one second must still find its claim held.
    monkeypatch.setattr(ctl, "LONG_POLL_S", 30.0)
    s = _Sender()
    yield s
    s.close()


def _claim_in_thread(sender: _Sender, key: bytes, hold_ms: int) -> tuple[threading.Thread, list]:
    out: list = []
    # Counted from the requests already answered: waiting for a fixed count let a test's
    # next claim overtake this one when an earlier claim had already reached that count.
    reached = sender.server.requests + 1
    thread = threading.Thread(target=lambda: out.append(sender.claim(key, hold_ms)))
    thread.start()
    give_up = time.monotonic() + 5
    while sender.server.requests < reached and time.monotonic() < give_up:
        time.sleep(0.001)  # the claim reached the server (and is held)
    assert sender.server.requests >= reached, "the claim never reached the server"
    return thread, out


def test_a_held_claim_is_answered_by_the_put(sender) -> None:
    thread, out = _claim_in_thread(sender, b"k1", 10_000)
    assert thread.is_alive()  # held, not answered MISSING
    sender.put(b"k1", b"payload")
    thread.join(5)
    answer, waited = out[0]
    assert answer == [ctl.OK, b"payload"]
    assert waited < 5  # the put answered it, not the 10 s hold
    assert sender.server.requests == 1  # one request, no polling


def test_a_held_claim_ends_missing_when_its_hold_does(sender) -> None:
    answer, waited = sender.claim(b"never", 100)
    assert answer == [ctl.MISSING] and waited >= 0.1


def test_a_claim_without_a_hold_and_one_past_max_held_are_answered_at_once(sender, monkeypatch) -> None:
    assert sender.claim(b"none", None)[0] == [ctl.MISSING]
    monkeypatch.setattr(ctl, "MAX_HELD", 1)
    thread, out = _claim_in_thread(sender, b"a", 10_000)  # the one held
    answer, waited = sender.claim(b"b", 10_000)
    assert answer == [ctl.MISSING] and waited < 5  # not held: over MAX_HELD
    sender.put(b"a", b"x")
    thread.join(5)
    assert out[0][0] == [ctl.OK, b"x"]


def test_two_receivers_held_for_one_key_one_gets_it_the_other_keeps_waiting(sender) -> None:
    first, out1 = _claim_in_thread(sender, b"k", 10_000)
    second, out2 = _claim_in_thread(sender, b"k", 300)
    sender.put(b"k", b"once")
    first.join(5)
    second.join(5)
    answers = sorted(a for a, _ in out1 + out2)
    assert answers == [[ctl.MISSING], [ctl.OK, b"once"]]  # the other waited out its hold


def test_the_hold_field_follows_the_deadline() -> None:
    assert ctl.hold_field(None) == []
    assert ctl.hold_field(time.monotonic()) == []  # no time left to hold
    (frame,) = ctl.hold_field(time.monotonic() + 60)
    assert ctl.U64.unpack(frame)[0] == int(ctl.LONG_POLL_S * 1000)


def _nixl():
    return create_connector("nixl", {"host": "127.0.0.1", "port": 0}), "_control"


def _te():
    return create_connector("mooncake-te", {"local_hostname": "127.0.0.1"}), "_server"


@pytest.mark.parametrize("make", [_nixl, pytest.param(_te, marks=pytest.mark.forked)], ids=["nixl", "te"])
def test_a_connector_get_waiting_before_the_put_is_one_held_request(make) -> None:
    """Both connectors on the long poll: a get that waits 0.3 s for the put sends one
    request, answered by the put (retries backing off to 20 ms sent 18-19)."""
    from connector_fixtures import deadline, key, make_payload, same

    (sender, attr), (receiver, _) = make(), make()
    with sender, receiver:
        metadata = sender.receiver_metadata()
        out: list = []
        thread = threading.Thread(
            target=lambda: out.append(receiver.get(0, 1, key(), metadata, deadline=deadline(10)))
        )
        thread.start()
        server = getattr(sender, attr)
        give_up = time.monotonic() + 5
        while server.requests < 1 and time.monotonic() < give_up:
            time.sleep(0.001)
        time.sleep(0.3)
        assert server.requests == 1
        assert sender.put(0, 1, key(), make_payload(5)).ok
        thread.join(10)
        assert same(out[0], make_payload(5))
        assert server.requests <= 2  # the held request, and NIXL's metadata / TE's DONE


def test_a_peer_cannot_hold_a_slot_longer_than_the_long_poll(sender, monkeypatch) -> None:
    monkeypatch.setattr(ctl, "LONG_POLL_S", 0.5)  # the server reads it per request
    answer, waited = sender.claim(b"never", 10**12)  # asks for ~30 years
    assert answer == [ctl.MISSING] and ctl.LONG_POLL_S <= waited < 5
