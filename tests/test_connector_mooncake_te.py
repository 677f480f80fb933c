"""MooncakeTransferEngineConnector specifics, on real transfer engines over TCP loopback.

The shared contract suite runs against it too (``connector_fixtures.CONNECTOR_SPECS``);
here: splitting large reads within the engine's queue limits, dead and hung peers, what
``close()`` releases, lease expiry, size refusal, the receiver's pool.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
import torch

pytest.register_assert_rewrite("connector_fixtures")
from connector_fixtures import child_put, deadline, key, make_payload, same  # noqa: E402

from vllm_kvbridge.connectors import create_connector  # noqa: E402
from vllm_kvbridge.errors import (  # noqa: E402
    ConfigError,
    TransferError,
    TransferRefused,
    TransferTimeout,
)

pytest_plugins = ["connector_fixtures"]
# slow: transfer engines and their processes per test, ~40 s in all
pytestmark = [pytest.mark.forked, pytest.mark.slow]

NAME = "MooncakeTransferEngineConnector"


def te(**config):
    return create_connector("mooncake-te", {"local_hostname": "127.0.0.1", **config})


def _refuses(host_port: str) -> bool:
    host, _, port = host_port.removeprefix("tcp://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


# -- large transfers -------------------------------------------------------------------
def _child_get_split(token: str, k: str, metadata: dict, seed: int, nbytes: int, out) -> None:
    with te(piece_bytes=1 << 20, max_batch_pieces=8) as conn:
        got = conn.get(0, 1, k, metadata, deadline=deadline(60))
        out.put((same(got, make_payload(seed, nbytes)), conn.health()["read_batches"]))


def test_two_processes_bit_exact_in_batches_of_pieces(token):
    """48 MiB read as 1 MiB pieces in batches of 8, by another process, byte for byte."""
    nbytes = 48 << 20
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with te() as sender:
        result = sender.put(0, 1, key(), make_payload(7, nbytes))
        assert result.ok and result.metadata["segment"].startswith("127.0.0.1:")
        child = ctx.Process(target=_child_get_split, args=(token, key(), result.metadata, 7, nbytes, out))
        child.start()
        exact, batches = out.get(timeout=120)
        child.join(30)
        assert child.exitcode == 0 and exact
        pieces = -(-result.nbytes // (1 << 20))
        assert batches == -(-pieces // 8) and batches > 1
        assert sender.health()["held_payloads"] == 0  # the receiver's DONE released it


@pytest.mark.slow
def test_8192_pieces_succeed_when_split_and_fail_clearly_in_one_batch():
    """The engine's TCP transport refuses a batch of 8,192 pieces ("TCP lane queue-full");
    the connector's split keeps every batch within the queue, and a batch configured over it
    is a clear error, never corrupt data."""
    n = (512 << 20) // 8
    big = {"big": torch.arange(n, dtype=torch.int64)}
    with te() as sender, te(piece_bytes=64 << 10) as receiver:
        result = sender.put(0, 1, key(), big)
        assert result.ok
        got = receiver.get(0, 1, key(), result.metadata, deadline=deadline(120))
        assert torch.equal(got["big"], big["big"])
        pieces = -(-result.nbytes // (64 << 10))
        assert pieces > 8192 and receiver.health()["read_batches"] == -(-pieces // 256)
        del got
    with te() as sender, te(piece_bytes=64 << 10, max_batch_pieces=8192) as receiver:
        result = sender.put(0, 1, key(), big)
        with pytest.raises(TransferError, match="max_batch_pieces=8192") as info:
            receiver.get(0, 1, key(), result.metadata, deadline=deadline(120))
        assert not isinstance(info.value, TransferTimeout)
        assert receiver.health()["get_failures"] == 1 and receiver.health()["lent_buffers"] == 0


# -- peers that die or hang ------------------------------------------------------------
def test_a_killed_sender_is_a_clear_error_well_within_the_deadline(token):
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=child_put, args=(NAME, token, key(), 1, 1 << 20, out, done, True))
    child.start()
    ok, metadata = out.get(timeout=60)
    child.join(30)
    assert ok and child.exitcode == 3
    with te() as receiver:
        start = time.monotonic()
        with pytest.raises(TransferError, match="is gone") as info:
            receiver.get(0, 1, key(), metadata, deadline=start + 30)
        assert time.monotonic() - start < 5 and not isinstance(info.value, TransferTimeout)
        with pytest.raises(TransferError, match="is gone"):  # no deadline: the same answer
            receiver.get(0, 1, key(), metadata)
        assert receiver.health()["get_failures"] == 2


def test_a_hung_sender_times_out_at_the_deadline(token):
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=child_put, args=(NAME, token, key(), 1, 1 << 16, out, done, False))
    child.start()
    try:
        ok, metadata = out.get(timeout=60)
        assert ok
        os.kill(child.pid, signal.SIGSTOP)  # alive (its ports accept connections) but silent
        with te() as receiver:
            start = time.monotonic()
            with pytest.raises(TransferTimeout):
                receiver.get(0, 1, key(), metadata, deadline=start + 0.5)
            assert 0.5 <= time.monotonic() - start < 3
            os.kill(child.pid, signal.SIGCONT)
            # Not lost: once the sender answers again the payload arrives.
            got = receiver.get(0, 1, key(), metadata, deadline=deadline(30))
            assert same(got, make_payload(1, 1 << 16))
    finally:
        os.kill(child.pid, signal.SIGCONT)
        done.set()
        child.join(30)
    assert child.exitcode == 0


def test_a_claim_whose_lease_expired_fails_instead_of_reading_stale_memory():
    with te(lease_s=0.1) as sender, te() as receiver:
        result = sender.put(0, 1, key(), make_payload(2))
        claim = receiver._claim(result.metadata["endpoint"], key(), deadline(5))  # reader stalls here
        assert claim is not None and sender.health()["claimed"] == 1
        give_up = deadline(10)
        while sender.health()["held_payloads"] and time.monotonic() < give_up:
            time.sleep(0.05)
        assert sender.health()["lease_expired"] == 1
        with pytest.raises(TransferError):  # the slab was unregistered: the engine refuses the read
            receiver._read(result.metadata["endpoint"], result.metadata["segment"], key(), *claim)
        assert receiver.health()["lent_buffers"] == 0
        assert receiver.get(0, 1, key(), result.metadata) is None  # nobody else reads it either


def test_a_claim_dropped_after_the_read_fails_the_get_at_done():
    """The bytes arrived, but the sender gave the claim up before DONE (lease ran out): the
    receiver cannot trust them, so the get fails instead of returning them."""
    with te() as sender, te() as receiver:
        result = sender.put(0, 1, key(), make_payload(2))
        read = receiver._transfer

        def read_then_sender_drops_the_claim(*args, **kwargs):
            read(*args, **kwargs)
            sender.cleanup(key())  # what the sender's sweep does when the lease expires

        receiver._transfer = read_then_sender_drops_the_claim
        with pytest.raises(TransferError, match="lease ran out"):
            receiver.get(0, 1, key(), result.metadata, deadline=deadline(5))
        assert receiver.health()["lent_buffers"] == 0 and sender.health()["held_payloads"] == 0


def test_malformed_control_requests_get_bad_and_the_server_keeps_serving():
    import zmq

    with te() as sender, te() as receiver:
        result = sender.put(0, 1, key(), make_payload(1))
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(result.metadata["endpoint"])
        answers = []
        for request in (
            [b"CLAIM", b"\x01" * 8, b"k"],
            [b"NOPE", b"\x02" * 8],
            [b"DONE", b"\x03" * 8, b"k", b"x"],
        ):
            sock.send_multipart(request)
            assert sock.poll(5000)
            answers.append(sock.recv_multipart())
        sock.send_multipart([b"CLAIM"])  # no nonce: dropped without an answer
        sock.close()
        ctx.term()
        assert [a[-1] for a in answers] == [b"BAD", b"BAD", b"BAD"]
        assert same(receiver.get(0, 1, key(), result.metadata, deadline=deadline(5)), make_payload(1))


def test_a_read_longer_than_the_lease_renews_it_between_batches():
    """Without renewal the sender's sweeper (every lease_s/4) drops the claim mid-read and the
    read fails; 256 MiB over TCP here takes several lease periods."""
    nbytes = 256 << 20
    with te(lease_s=0.15) as sender, te(max_batch_pieces=2) as receiver:  # the sender's lease rules
        result = sender.put(0, 1, key(), make_payload(6, nbytes))
        got = receiver.get(0, 1, key(), result.metadata, deadline=deadline(60))
        assert same(got, make_payload(6, nbytes))
        assert receiver.health()["lease_renewals"] >= 1 and sender.health()["lease_expired"] == 0


def test_a_claimed_key_is_invisible_to_other_receivers():
    with te() as sender, te() as first, te() as second:
        result = sender.put(0, 1, key(), make_payload(3))
        claim = first._claim(result.metadata["endpoint"], key(), deadline(5))
        assert claim is not None
        assert second.get(0, 1, key(), result.metadata) is None
        # ...while the claimer asking again gets the same lease (a timed-out claim is not lost)
        assert first._claim(result.metadata["endpoint"], key(), deadline(5)) == claim
        got = first.get(0, 1, key(), result.metadata, deadline=deadline(5))
        assert same(got, make_payload(3)) and sender.health()["held_payloads"] == 0


def test_renew_leaves_a_claim_to_its_lease_and_a_read_key_is_not_renewed():
    """RENEW (te_control): a claimed key answers True but keeps its claim's expiry, so
    renewals by a waiting receiver cannot keep a dead reader's slab; once read: False."""
    with te(lease_s=0.3) as sender, te() as first, te() as second:
        result = sender.put(0, 1, key(1), make_payload(1))
        assert first._claim(result.metadata["endpoint"], key(1), deadline(5)) is not None  # then dies
        assert second.renew(0, 1, key(1), result.metadata)  # held (claimed): True
        give_up = deadline(5)
        while second.renew(0, 1, key(1), result.metadata):  # renewing as a waiting receiver does
            assert time.monotonic() < give_up, "a renewal extended a claim's lease"
            time.sleep(0.05)
        assert sender.health()["lease_expired"] == 1 and sender.health()["expired"] == 0
        result = sender.put(0, 1, key(2), make_payload(2))
        assert same(first.get(0, 1, key(2), result.metadata, deadline=deadline(5)), make_payload(2))
        assert not first.renew(0, 1, key(2), result.metadata)
        assert not second.renew(0, 1, key(2), result.metadata)


def test_renew_against_a_dead_or_hung_sender_raises_within_its_bound():
    with te(request_timeout_s=0.5) as receiver:
        with socket.socket() as hung:  # listens, never answers
            hung.bind(("127.0.0.1", 0))
            hung.listen()
            free = socket.socket()
            free.bind(("127.0.0.1", 0))
            dead = f"tcp://127.0.0.1:{free.getsockname()[1]}"
            free.close()  # nobody listens there now
            start = time.monotonic()
            with pytest.raises(TransferError, match="gone"):
                receiver.renew(0, 1, key(), {"endpoint": dead})
            assert time.monotonic() - start < 0.5
            start = time.monotonic()
            with pytest.raises(TransferTimeout):
                receiver.renew(0, 1, key(), {"endpoint": f"tcp://127.0.0.1:{hung.getsockname()[1]}"})
            assert 0.5 <= time.monotonic() - start < 2.5
        with pytest.raises(TransferError, match="endpoint"):
            receiver.renew(0, 1, key(), {})


# -- resources ------------------------------------------------------------------------
def _cycle() -> None:
    with te() as sender, te() as receiver:
        metadata = sender.put(0, 1, key(), make_payload(0)).metadata
        assert receiver.get(0, 1, key(), metadata, deadline=deadline(5)) is not None


def test_close_releases_engine_port_control_socket_threads_and_registrations():
    # Warm-up: process-wide singletons (torch's and glog's threads) are not the connector's.
    _cycle()
    gc.collect()
    base_threads, base_fds = _threads(), len(os.listdir("/proc/self/fd"))
    sender, receiver = te(), te()
    assert _threads() > base_threads  # the engines' threads exist while open (the check can fail)
    result = sender.put(0, 1, key(), make_payload(4, 4 << 20))
    sender.put(0, 1, key(2), make_payload(5, 4 << 20))  # never read: held at close
    held = receiver.get(0, 1, key(), result.metadata, deadline=deadline(5))
    segments = [sender.health()["segment"], receiver.health()["segment"]]
    endpoint = result.metadata["endpoint"]
    assert sender.health()["registered_bytes"] > 0 and receiver.health()["lent_buffers"] == 1
    assert not any(_refuses(s) for s in segments) and not _refuses(endpoint)
    receiver.close()
    sender.close()
    assert sender.health()["registered_bytes"] == 0 and receiver.health()["registered_bytes"] == 0
    assert sender.health()["held_payloads"] == 0
    assert all(_refuses(s) for s in segments) and _refuses(endpoint)
    assert same(held, make_payload(4, 4 << 20))  # the tensors outlive the connector
    del held
    gc.collect()
    assert _threads() <= base_threads and len(os.listdir("/proc/self/fd")) <= base_fds


def test_receiver_slabs_return_to_the_pool_when_the_tensors_go():
    with te() as sender, te() as receiver:
        metadata = sender.put(0, 1, key(1), make_payload(1, 2 << 20)).metadata
        got = receiver.get(0, 1, key(1), metadata, deadline=deadline(5))
        assert receiver.health()["lent_buffers"] == 1
        registered = receiver.health()["registered_bytes"]
        del got
        gc.collect()
        assert receiver.health()["lent_buffers"] == 0
        metadata = sender.put(0, 1, key(2), make_payload(2, 2 << 20)).metadata
        assert same(receiver.get(0, 1, key(2), metadata, deadline=deadline(5)), make_payload(2, 2 << 20))
        assert receiver.health()["registered_bytes"] == registered  # the same slab, reused


def test_oversize_payload_is_refused_before_any_read_and_kept_for_others():
    with te() as sender, te(max_payload_bytes=1 << 16) as small, te() as big:
        result = sender.put(0, 1, key(), make_payload(1, 1 << 20))
        with pytest.raises(TransferRefused, match="max_payload_bytes"):
            small.get(0, 1, key(), result.metadata, deadline=deadline(5))
        assert small.health()["read_batches"] == 0
        assert same(big.get(0, 1, key(), result.metadata, deadline=deadline(5)), make_payload(1, 1 << 20))


def test_held_bytes_are_bounded():
    with te(max_held_bytes=3 << 20) as sender, te() as receiver:
        first = sender.put(0, 1, key(1), make_payload(1, 2 << 20))
        refused = sender.put(0, 1, key(2), make_payload(2, 2 << 20))
        assert first.ok and not refused.ok and "max_held_bytes" in refused.error
        receiver.get(0, 1, key(1), first.metadata, deadline=deadline(5))
        assert sender.put(0, 1, key(2), make_payload(2, 2 << 20)).ok


def test_bad_config_and_missing_metadata_are_clear_errors():
    with pytest.raises(ConfigError, match="protocol"):
        te(protocol="udp")
    with pytest.raises(ConfigError, match="piece_bytes"):
        te(piece_bytes=-1)
    # No RDMA NIC on this machine: refused at construction, not at the first transfer.
    with pytest.raises(TransferError, match="no RDMA device"):
        te(protocol="rdma", device_name="mlx5_0")
    with te() as receiver, pytest.raises(TransferError, match="endpoint"):
        receiver.get(0, 1, key(), {}, deadline=deadline(1))
