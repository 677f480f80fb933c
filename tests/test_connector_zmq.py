"""ZmqConnector specifics: size limits, in-flight bound, CURVE, dead peers, missing metadata."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import zmq

pytest.register_assert_rewrite("connector_fixtures")
from connector_fixtures import child_put, deadline, key, make_payload, same  # noqa: E402

from vllm_kvbridge.connectors import create_connector  # noqa: E402
from vllm_kvbridge.errors import ConfigError, TransferError, TransferRefused, TransferTimeout  # noqa: E402

pytest_plugins = ["connector_fixtures"]
pytestmark = pytest.mark.forked


def zmq_conn(**config):
    return create_connector("zmq", {"host": "127.0.0.1", "port": 0, **config})


def test_oversize_payload_is_refused_before_sending():
    with zmq_conn() as sender, zmq_conn(max_payload_bytes=1 << 16) as receiver:
        result = sender.put(0, 1, key(), make_payload(1, 1 << 20))
        assert result.ok
        with pytest.raises(TransferRefused, match="max_payload_bytes"):
            receiver.get(0, 1, key(), result.metadata, deadline=deadline(5))
        assert sender.health()["held_payloads"] == 1  # not consumed: a bigger receiver may take it
    with zmq_conn(max_payload_bytes=1 << 16) as small_sender:
        result = small_sender.put(0, 1, key(), make_payload(1, 1 << 20))
        assert not result.ok and "max_payload_bytes" in result.error


def test_inflight_bytes_are_bounded_and_released_on_get():
    with zmq_conn(max_inflight_bytes=3 << 20) as sender, zmq_conn() as receiver:
        first = sender.put(0, 1, key(1), make_payload(1, 2 << 20))
        refused = sender.put(0, 1, key(2), make_payload(2, 2 << 20))
        assert first.ok and not refused.ok and "max_inflight_bytes" in refused.error
        got = receiver.get(0, 1, key(1), first.metadata, deadline=deadline(5))
        assert same(got, make_payload(1, 2 << 20))
        assert sender.put(0, 1, key(2), make_payload(2, 2 << 20)).ok
        sender.cleanup(key(2))
        assert sender.health()["inflight_bytes"] == 0


def test_get_without_an_endpoint_raises_a_clear_error():
    with zmq_conn() as receiver:
        with pytest.raises(TransferError, match="no endpoint"):
            receiver.get(0, 1, key(), None, deadline=deadline(1))
        with pytest.raises(TransferError, match="no endpoint"):
            receiver.get(0, 1, key(), {"other": 1})


def test_peer_gone_times_out():
    sender = zmq_conn()
    metadata = sender.put(0, 1, key(), make_payload(1)).metadata
    sender.close()
    with zmq_conn(request_timeout_s=0.3) as receiver:
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            receiver.get(0, 1, key(), metadata, deadline=start + 0.5)
        assert 0.5 <= time.monotonic() - start < 3
        with pytest.raises(TransferTimeout):  # no deadline: one request, no answer
            receiver.get(0, 1, key(), metadata)


def test_killed_sender_process_times_out(token):
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=child_put, args=("ZmqConnector", token, key(), 1, 1 << 16, out, done, True))
    child.start()
    ok, metadata = out.get(timeout=60)
    child.join(30)
    assert ok and child.exitcode == 3
    with zmq_conn() as receiver, pytest.raises(TransferTimeout):
        receiver.get(0, 1, key(), metadata, deadline=deadline(0.5))


def _curve_pair():
    server_pub, server_sec = zmq.curve_keypair()
    good_pub, good_sec = zmq.curve_keypair()
    bad_pub, bad_sec = zmq.curve_keypair()
    keys = {
        k: v.decode()
        for k, v in dict(
            server_pub=server_pub,
            server_sec=server_sec,
            good_pub=good_pub,
            good_sec=good_sec,
            bad_pub=bad_pub,
            bad_sec=bad_sec,
        ).items()
    }
    server = zmq_conn(
        curve_public_key=keys["server_pub"],
        curve_secret_key=keys["server_sec"],
        curve_allowed_clients=[keys["good_pub"]],
    )
    return server, keys


def test_curve_admits_only_configured_clients():
    server, keys = _curve_pair()
    with server:
        result = server.put(0, 1, key(), make_payload(1))
        assert result.metadata["server_key"] == keys["server_pub"]
        intruders = [
            zmq_conn(
                curve_public_key=keys["bad_pub"], curve_secret_key=keys["bad_sec"], curve_allowed_clients=[]
            ),
            zmq_conn(),  # plain TCP, no CURVE at all
        ]
        for intruder in intruders:
            with intruder, pytest.raises(TransferTimeout):
                intruder.get(0, 1, key(), result.metadata, deadline=deadline(0.5))
        assert server.health()["held_payloads"] == 1  # the intruders got nothing
        with zmq_conn(
            curve_public_key=keys["good_pub"], curve_secret_key=keys["good_sec"], curve_allowed_clients=[]
        ) as client:
            got = client.get(0, 1, key(), result.metadata, deadline=deadline(5))
            assert same(got, make_payload(1))


def test_curve_config_is_validated():
    pub, _ = zmq.curve_keypair()
    with pytest.raises(ConfigError):
        zmq_conn(curve_public_key=pub.decode())  # no secret key
    with pytest.raises(ConfigError):
        zmq_conn(curve_public_key="short", curve_secret_key="short", curve_allowed_clients=[])
    pub, sec = zmq.curve_keypair()
    with pytest.raises(ConfigError):
        zmq_conn(curve_public_key=pub.decode(), curve_secret_key=sec.decode())  # no allow-list


def test_malformed_request_gets_bad_answer_and_server_survives():
    with zmq_conn() as sender, zmq_conn() as receiver:
        result = sender.put(0, 1, key(), make_payload(1))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(result.metadata["endpoint"])
        sock.send_multipart([b"GET", b"12345678"])  # too few frames
        assert sock.poll(5000)
        assert sock.recv_multipart()[-1] == b"BAD"
        sock.close()
        ctx.term()
        assert same(receiver.get(0, 1, key(), result.metadata, deadline=deadline(5)), make_payload(1))


# -- a deadline bounds availability, not the transfer (issue 11, case 1) ------------------
def test_a_get_deadline_shorter_than_the_transfer_still_delivers():
    """The KV manager polls in short slices: a payload whose transfer outlives one slice must
    still arrive (on the old protocol the server dropped the entry when it started sending and
    the timed-out client closed its socket, so the payload was lost)."""
    nbytes = 256 << 20
    with zmq_conn() as sender, zmq_conn() as receiver:
        result = sender.put(0, 1, key(), make_payload(3, nbytes))
        assert result.ok
        give_up, got, slices = deadline(60), None, 0
        while got is None and time.monotonic() < give_up:
            slices += 1
            try:
                got = receiver.get(0, 1, key(), result.metadata, deadline=deadline(0.02))
            except TransferTimeout:
                continue
        assert got is not None, f"payload lost after {slices} slices of 20 ms"
        assert same(got, make_payload(3, nbytes))
        # get() returns only once the sender has dropped its copy.
        assert sender.health()["held_payloads"] == 0 and sender.health()["inflight_bytes"] == 0


def _raw_get_without_confirming(endpoint: str, k: str) -> list[bytes]:
    """Speak the request half of the protocol, take whatever comes back, never confirm."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    sock.send_multipart([b"GET", b"\x00" * 8, k.encode(), (1 << 40).to_bytes(8, "little")])
    replies = []
    while sock.poll(2000):
        replies.append(sock.recv_multipart())
    sock.close()
    ctx.term()
    return replies


def test_the_entry_stays_until_the_receiver_confirms():
    with zmq_conn() as sender, zmq_conn() as receiver:
        result = sender.put(0, 1, key(), make_payload(4, 1 << 20))
        replies = _raw_get_without_confirming(result.metadata["endpoint"], key())
        assert replies and replies[0][1] == b"OK"  # the data went out ...
        assert sender.health()["held_payloads"] == 1  # ... but unconfirmed, so it is kept
        got = receiver.get(0, 1, key(), result.metadata, deadline=deadline(5))
        assert same(got, make_payload(4, 1 << 20))
        assert sender.health()["held_payloads"] == 0


def test_an_unconfirmed_entry_expires_at_its_ttl():
    with zmq_conn(ttl_s=0.3) as sender:
        result = sender.put(0, 1, key(), make_payload(5))
        _raw_get_without_confirming(result.metadata["endpoint"], key())
        give_up = deadline(10)
        while sender.health()["held_payloads"] and time.monotonic() < give_up:
            time.sleep(0.05)
        assert sender.health()["held_payloads"] == 0 and sender.health()["inflight_bytes"] == 0


def test_a_confirm_for_an_unknown_key_is_harmless():
    with zmq_conn() as sender, zmq_conn() as receiver:
        result = sender.put(0, 1, key(), make_payload(6))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(result.metadata["endpoint"])
        sock.send_multipart([b"ACK", b"\x01" * 8, b"no-such-key"])
        assert sock.poll(5000) and sock.recv_multipart()[-1] == b"ACKED"
        sock.close()
        ctx.term()
        assert same(receiver.get(0, 1, key(), result.metadata, deadline=deadline(5)), make_payload(6))


def test_tp_ranks_with_a_fixed_port_bind_one_port_each():
    """Issue 11, case 7: every TP rank of a KV-sending stage made its connector from the
    same edge config, so with a fixed ``port`` all ranks bound the same port (the second
    rank's sends failed). A fixed port P means rank r binds P + r."""
    import socket

    with socket.socket() as s:  # two free ports in a row are likely; retry a few bases
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    ranks = [create_connector("zmq", {"host": "127.0.0.1", "port": base}, rank=r) for r in (0, 1)]
    try:
        results = [conn.put(0, 1, key(r), make_payload(r)) for r, conn in enumerate(ranks)]
        assert all(r.ok for r in results), [r.error for r in results]
        assert [r.metadata["endpoint"] for r in results] == [f"tcp://127.0.0.1:{base + i}" for i in (0, 1)]
    finally:
        for conn in ranks:
            conn.close()
    with create_connector("zmq", {"host": "127.0.0.1", "port": 0}, rank=3) as any_port:
        assert any_port.port == 0  # ephemeral ports need no offset


def test_a_run_binding_zmq_beyond_loopback_gets_curve_and_refuses_peers_without_the_key(monkeypatch):
    """Issue 15, item 5: CURVE is on by default for a ZMQ edge bound beyond loopback. The
    pipeline gives the edge's two stages (only them) one keypair per run in their environment;
    the edge's own stages talk, a peer without the key (plain or another keypair) gets nothing.
    A loopback edge, and one with keys of its own, are left alone."""
    import json

    from vllm_kvbridge.config import resolve_spec, spec_from_dict
    from vllm_kvbridge.pipeline.stage_handles import with_run_curve_keys

    def plan(extra, receiver_extra=None):
        cfg = {
            "connectors": {
                "z": {"name": "zmq", "extra": extra},
                "zin": {"name": "zmq", "extra": receiver_extra},
            },
            "stages": [
                {"stage_id": 0, "kind": "llm_ar", "model": "m", "kv_transfer": {"need_send_cache": True}},
                {
                    "stage_id": 1,
                    "kind": "diffusion",
                    "kv_transfer": {"need_recv_cache": True},
                    # model "m" is a placeholder: the DiT's KV geometry is given here
                    "diffusion": {"kwargs": {"kv_heads": 2, "kv_head_dim": 32}},
                },
            ],
            "edges": [{"from_stage": 0, "to_stage": 1, "connector": "z"}],
        }
        if receiver_extra is not None:  # the receiving end names a connector of its own
            cfg["stages"][1]["input_connectors"] = {"from_stage_0": "zin"}
        else:
            del cfg["connectors"]["zin"]
        return resolve_spec(spec_from_dict(cfg)).stages

    own_keys = {"curve_public_key": "x" * 40}
    for args in (
        ({"host": "127.0.0.1"},),
        ({"host": "0.0.0.0", **own_keys},),
        ({"host": "0.0.0.0"}, own_keys),
    ):
        assert with_run_curve_keys(plan(*args)) == plan(*args), args
    sender_stage, receiver_stage = with_run_curve_keys(plan({"host": "0.0.0.0"}))
    [var] = [k for k in sender_stage.env if k.startswith("KVBRIDGE_CURVE_")]
    assert receiver_stage.env[var] == sender_stage.env[var]  # both ends, the same pair
    assert sender_stage.outputs[0].connector.config["curve_keys_env"] == var
    assert receiver_stage.inputs[0].connector.config["curve_keys_env"] == var
    assert set(json.loads(sender_stage.env[var])) == {"public", "secret"}
    other = with_run_curve_keys(plan({"host": "0.0.0.0"}))[0].env[var]
    assert other != sender_stage.env[var]  # a new pair per run

    monkeypatch.setenv(var, sender_stage.env[var])
    edge_config = dict(sender_stage.outputs[0].connector.config)
    with create_connector("zmq", edge_config) as server:
        result = server.put(0, 1, key(), make_payload(1))
        assert result.ok
        port = result.metadata["endpoint"].rsplit(":", 1)[1]
        metadata = {**result.metadata, "endpoint": f"tcp://127.0.0.1:{port}"}  # reach it on loopback
        stranger_pub, stranger_sec = (k.decode() for k in zmq.curve_keypair())
        strangers = [
            zmq_conn(),  # plain TCP
            zmq_conn(curve_public_key=stranger_pub, curve_secret_key=stranger_sec, curve_allowed_clients=[]),
        ]
        for stranger in strangers:
            with stranger, pytest.raises(TransferTimeout):
                stranger.get(0, 1, key(), metadata, deadline=deadline(0.5))
        assert server.health()["held_payloads"] == 1
        with create_connector("zmq", {**edge_config, "host": "127.0.0.1"}) as peer:
            assert same(peer.get(0, 1, key(), metadata, deadline=deadline(5)), make_payload(1))
    monkeypatch.delenv(var)
    with pytest.raises(ConfigError, match=f"{var} is not set"):
        create_connector("zmq", edge_config)


# -- long-poll: a get with a deadline is answered when the put lands ----------------------------
def _count_requests(receiver, monkeypatch) -> list[float]:
    """Record each GET the receiver sends (its ``hold``)."""
    sent: list[float] = []
    request = receiver._request

    def counting(sock, k, wait_until, hold=0.0):
        sent.append(hold)
        return request(sock, k, wait_until, hold)

    monkeypatch.setattr(receiver, "_request", counting)
    return sent


def _get_in_thread(receiver, metadata) -> tuple:
    import threading

    got: list = []
    t = threading.Thread(
        target=lambda: got.append(receiver.get(0, 1, key(), metadata, deadline=deadline(60)))
    )
    t.start()
    return t, got


def _until(pred, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"{what} not within {timeout} s"
        time.sleep(0.005)


def test_a_waiting_get_is_held_by_the_server_and_answered_by_the_put(monkeypatch):
    from vllm_kvbridge.connectors import zmq_server

    monkeypatch.setattr(zmq_server, "LONG_POLL_S", 600.0)  # no hold may run out in this test
    with zmq_conn() as sender, zmq_conn() as receiver:
        sent = _count_requests(receiver, monkeypatch)
        t, got = _get_in_thread(receiver, sender.receiver_metadata())
        _until(lambda: sender.health()["held_gets"] == 1, "the server holding the get")
        assert sender.put(0, 1, key(), make_payload(3)).ok
        t.join(60)
        assert not t.is_alive() and same(got[0], make_payload(3))
        # One request: the server answered it when the put landed (no retry found it).
        assert len(sent) == 1 and sent[0] > 1.0
        assert sender.health()["held_gets"] == 0 and sender.health()["held_payloads"] == 0


def test_a_held_get_ends_missing_before_its_deadline_and_keeps_its_socket(monkeypatch):
    with zmq_conn() as sender, zmq_conn() as receiver:
        sent = _count_requests(receiver, monkeypatch)
        with pytest.raises(TransferTimeout, match="not available"):
            receiver.get(0, 1, key(), sender.receiver_metadata(), deadline=deadline(0.5))
        # Held, answered "missing" just before the deadline (then at most a few quick
        # tries in the last 10 ms; retrying alone makes ~30 in 0.5 s), and the socket went
        # back to the pool (a get that heard no answer closes its socket).
        assert sent[0] > 0.4 and len(sent) <= 6
        assert sum(len(s) for s in receiver._idle.values()) == 1
        assert sender.health()["held_gets"] == 0


def test_a_server_holding_too_many_gets_answers_at_once_and_the_get_retries(monkeypatch):
    from vllm_kvbridge.connectors import zmq_server

    monkeypatch.setattr(zmq_server, "MAX_WAITERS", 0)
    with zmq_conn() as sender, zmq_conn() as receiver:
        sent = _count_requests(receiver, monkeypatch)
        t, got = _get_in_thread(receiver, sender.receiver_metadata())
        _until(lambda: len(sent) >= 3, "the receiver retrying")  # answered at once: it backs off
        assert sender.health()["held_gets"] == 0
        assert sender.put(0, 1, key(), make_payload(4)).ok
        t.join(60)
        assert not t.is_alive() and same(got[0], make_payload(4))


# -- pooled send buffers: a reserved buffer is reused once its payload was confirmed ------------
def _reserve_packed(sender, k: str, payload):
    from vllm_kvbridge.wire import encode

    enc = encode(payload)
    r = sender.reserve(0, 1, k, enc.packed_size())
    enc.pack_into(r.buffer)
    return r


def test_a_reserved_send_buffer_returns_to_the_pool_only_after_the_receiver_confirmed():
    with zmq_conn() as sender, zmq_conn() as receiver:
        first = _reserve_packed(sender, key(1), make_payload(1, 3 << 20))
        assert first.publish().ok
        # Held for the receiver: not reusable, so the next reservation is another buffer.
        second = _reserve_packed(sender, key(2), make_payload(2, 3 << 20))
        assert sender._buffers.lent == 2
        assert second.publish().ok
        metadata = sender.receiver_metadata()
        for i in (1, 2):
            got = receiver.get(0, 1, key(i), metadata, deadline=deadline(10))
            assert same(got, make_payload(i, 3 << 20))
            del got
        # Confirmed and sent: libzmq drops its references on its own thread, then both
        # buffers are back in the pool (pages faulted in, kept within pool_keep_bytes).
        _until(lambda: sender._buffers.lent == 0, "the buffers' return")
        assert sender._buffers.pooled_bytes >= 2 * (3 << 20)
        free = {slab.ctypes.data for slab in sender._buffers._free}
        third = _reserve_packed(sender, key(3), make_payload(3, 3 << 20))
        assert sender._buffers.lent == 1 and third.buffer.obj.ctypes.data in free  # reused
        third.release()
        _until(lambda: sender._buffers.lent == 0, "a released reservation's buffer")


def test_pool_keep_bytes_zero_keeps_no_send_buffer():
    with zmq_conn(pool_keep_bytes=0) as sender, zmq_conn() as receiver:
        r = _reserve_packed(sender, key(), make_payload(1, 1 << 20))
        assert r.publish().ok
        got = receiver.get(0, 1, key(), sender.receiver_metadata(), deadline=deadline(10))
        assert same(got, make_payload(1, 1 << 20))
        del got
        _until(lambda: sender._buffers.lent == 0, "the buffer's release")
        assert sender._buffers.pooled_bytes == 0
