"""The contract every connector keeps (see ``vllm_kvbridge.connectors.base``).

Parameterised over ``connector_fixtures.CONNECTOR_SPECS``: a new connector adds a spec
there and runs this whole suite unchanged.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
import torch

pytest.register_assert_rewrite("connector_fixtures")
from connector_fixtures import (  # noqa: E402
    child_get,
    child_put,
    deadline,
    key,
    make_payload,
    same,
)

from vllm_kvbridge.errors import ConnectorClosed, TransferError, TransferTimeout  # noqa: E402
from vllm_kvbridge.wire import NUMPY_DTYPES, TORCH_DTYPES  # noqa: E402

pytest_plugins = ["connector_fixtures"]
pytestmark = pytest.mark.forked


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_roundtrip_in_process(pair):
    sender, receiver = pair
    payload = make_payload(1)
    result = sender.put(0, 1, key(), payload)
    assert result.ok and result.nbytes > 0
    assert same(receiver.get(0, 1, key(), result.metadata, deadline=deadline(5)), payload)
    assert receiver.health()["gets"] == 1 and sender.health()["puts"] == 1


def test_put_in_one_process_get_in_another(spec, token):
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    # parent puts, child gets
    with spec.make(token) as sender:
        result = sender.put(0, 1, key(1), make_payload(11, 1 << 20))
        assert result.ok
        args = (spec.name, token, key(1), result.metadata, 11, 1 << 20, out)
        child = ctx.Process(target=child_get, args=args)
        child.start()
        assert out.get(timeout=60) == ("ok", True)
        child.join(30)
        assert child.exitcode == 0
    # child puts, parent gets
    child = ctx.Process(target=child_put, args=(spec.name, token, key(2), 12, 1 << 20, out, done, False))
    child.start()
    try:
        ok, metadata = out.get(timeout=60)
        assert ok
        with spec.make(token) as receiver:
            got = receiver.get(0, 1, key(2), metadata, deadline=deadline(30))
            assert same(got, make_payload(12, 1 << 20))
            del got
    finally:
        done.set()
        child.join(30)
    assert child.exitcode == 0
    assert spec.leftovers(token) == []


def test_get_before_put_times_out_or_returns_none(pair):
    sender, receiver = pair
    metadata = sender.put(0, 1, key("other"), make_payload(0)).metadata  # the sender exists
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        receiver.get(0, 1, key("absent"), metadata, deadline=start + 0.4)
    elapsed = time.monotonic() - start
    assert 0.4 <= elapsed < 3.0
    assert receiver.get(0, 1, key("absent"), metadata) is None
    assert receiver.health()["timeouts"] == 1 and receiver.health()["get_misses"] == 1


def test_get_waits_for_a_late_put(pair):
    sender, receiver = pair
    metadata = sender.put(0, 1, key("warm"), make_payload(0)).metadata
    payload = make_payload(5)
    timer = threading.Timer(0.3, sender.put, args=(0, 1, key("late"), payload))
    timer.start()
    try:
        got = receiver.get(0, 1, key("late"), metadata, deadline=deadline(10))
    finally:
        timer.join()
    assert same(got, payload)


def test_receiver_metadata_taken_before_any_put_reaches_later_puts(pair):
    """What an async-chunk consumer (or a TP peer started early) has: the sender's
    ``receiver_metadata()``, taken before anything was put, reaches every later put."""
    sender, receiver = pair
    up_front = sender.receiver_metadata()
    assert isinstance(up_front, dict)
    for i in range(2):
        payload = make_payload(20 + i)
        assert sender.put(0, 1, key(f"early{i}"), payload).ok
        assert same(receiver.get(0, 1, key(f"early{i}"), up_front, deadline=deadline(10)), payload)


def test_concurrent_put_get_from_8_threads(pair):
    sender, receiver = pair
    metadata = sender.put(0, 1, key("warm"), make_payload(0)).metadata
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(12):
                seed = 1000 * t + i
                k = key(f"t{t}", chunk=i)
                if i % 2:  # half the gets start before their put
                    getter = threading.Thread(
                        target=lambda k=k, s=seed: results.append(
                            (s, receiver.get(0, 1, k, metadata, deadline=deadline(20)))
                        )
                    )
                    getter.start()
                    assert sender.put(0, 1, k, make_payload(seed, 4096)).ok
                    getter.join()
                else:
                    assert sender.put(0, 1, k, make_payload(seed, 4096)).ok
                    results.append((seed, receiver.get(0, 1, k, metadata, deadline=deadline(20))))
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    results: list = []
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 8 * 12
    assert all(same(got, make_payload(seed, 4096)) for seed, got in results)


@pytest.mark.slow
def test_one_gib_payload(pair):
    sender, receiver = pair
    n = (1 << 30) // 8
    big = torch.arange(n, dtype=torch.int64)  # cheap to make, every byte position distinct
    result = sender.put(0, 1, key("big"), {"big": big})
    assert result.ok and result.nbytes >= 1 << 30
    got = receiver.get(0, 1, key("big"), result.metadata, deadline=deadline(120))["big"]
    assert got.shape == big.shape and torch.equal(got, big)
    del got, big
    gc.collect()


def test_destructive_read(pair):
    sender, receiver = pair
    result = sender.put(0, 1, key(), make_payload(3))
    assert same(receiver.get(0, 1, key(), result.metadata, deadline=deadline(5)), make_payload(3))
    assert receiver.get(0, 1, key(), result.metadata) is None
    with pytest.raises(TransferTimeout):
        receiver.get(0, 1, key(), result.metadata, deadline=deadline(0.2))


def test_cleanup_and_close_are_idempotent_and_close_refuses_use(pair):
    sender, receiver = pair
    result = sender.put(0, 1, key(), make_payload(3))
    sender.cleanup(key())
    sender.cleanup(key())
    receiver.cleanup(key())
    assert receiver.get(0, 1, key(), result.metadata) is None
    sender.close()
    sender.close()
    receiver.close()
    with pytest.raises(ConnectorClosed):
        sender.put(0, 1, key(), make_payload(3))
    with pytest.raises(ConnectorClosed):
        receiver.get(0, 1, key(), result.metadata)
    assert sender.health()["closed"] is True


def _cycle(spec, token: str, rounds: int):
    sender, receiver = spec.make(token), spec.make(token)
    metadata = {}
    for i in range(rounds):
        metadata = sender.put(0, 1, key(i), make_payload(i, 1 << 18)).metadata
    held = receiver.get(0, 1, key(0), metadata, deadline=deadline(5))  # tensors still alive
    receiver.get(0, 1, key(1), metadata, deadline=deadline(5))  # dropped at once
    assert receiver.get(0, 1, key("nope"), metadata) is None
    receiver.close()
    sender.close()
    assert same(held, make_payload(0, 1 << 18))  # tensors stay valid after close
    del held
    gc.collect()
    return metadata


def test_nothing_left_after_close(spec, token):
    # Warm-up: process-wide singletons (pyzmq's zero-copy garbage-collector context keeps
    # a few eventfds for the life of the process) are not the connector's to release.
    _cycle(spec, token + "w", 2)
    fds_before = _open_fds()
    metadata = _cycle(spec, token, 4)
    assert spec.leftovers(token) == []
    assert _open_fds() <= fds_before
    if "endpoint" in metadata:  # nobody listens there any more: a timeout, or a dead-peer error
        with spec.make(token) as probe, pytest.raises(TransferError):
            probe.get(0, 1, key(2), metadata, deadline=deadline(0.3))


def test_every_dtype_round_trips_bit_exact(pair):
    sender, receiver = pair
    gen = torch.Generator().manual_seed(0)
    payload = {}
    for name, dtype in TORCH_DTYPES.items():
        raw = torch.randint(0, 256, (3, 5 * dtype.itemsize), generator=gen, dtype=torch.uint8)
        if dtype == torch.bool:
            raw = raw % 2
        payload[f"t_{name}"] = raw.view(dtype)
    for name, dtype in NUMPY_DTYPES.items():
        arr = np.random.default_rng(1).integers(0, 256, size=4 * dtype.itemsize, dtype=np.uint8)
        if dtype == np.bool_:
            arr = arr % 2
        payload[f"a_{name}"] = arr.view(dtype)
    payload["empty"] = torch.empty(0, 3)
    payload["scalars"] = [1, 2.5, "x", b"y", None, True]
    result = sender.put(0, 1, key(), payload)
    got = receiver.get(0, 1, key(), result.metadata, deadline=deadline(5))
    assert same(got, payload)
    assert not same(got["t_float32"], payload["t_float32"] + 1)  # the comparison can fail


def test_ttl_reaps_unclaimed_payloads(spec, token):
    with spec.make(token, ttl_s=0.2) as sender, spec.make(token) as receiver:
        result = sender.put(0, 1, key(), make_payload(1))
        assert result.ok
        time.sleep(1.5)
        assert receiver.get(0, 1, key(), result.metadata) is None
        assert sender.health().get("held_payloads", 0) == 0 and sender.health().get("published", 0) == 0
        assert sender.health()["expired"] == 1
        # ...while a payload claimed in time is delivered
        result = sender.put(0, 1, key(2), make_payload(2))
        assert same(receiver.get(0, 1, key(2), result.metadata, deadline=deadline(5)), make_payload(2))
    assert spec.leftovers(token) == []


def test_a_renewed_payload_outlives_its_ttl_and_goes_a_lease_after_the_last_renewal(spec, token):
    """Issue 11 case 11 / issue 15 item 3: a receiver that still waits renews what it waits
    for, and keeps it past the TTL (a long queue in front of it); once it stops renewing
    (it died), the payload is dropped about one lease later and counted as expired.
    The margins: renewals every 0.2 s against a 2 s lease; the TTL is 0.5 s."""
    ttl_s, lease_s = 0.5, 2.0
    with spec.make(token, ttl_s=ttl_s, lease_s=lease_s) as sender, spec.make(token) as receiver:
        kept, dropped = sender.put(0, 1, key(1), make_payload(1)), sender.put(0, 1, key(2), make_payload(2))
        assert kept.ok and dropped.ok
        assert kept.metadata["lease_s"] == lease_s
        end = time.monotonic() + 4 * ttl_s
        while time.monotonic() < end:  # four TTLs, renewing both
            assert receiver.renew(0, 1, key(1), kept.metadata)
            assert receiver.renew(0, 1, key(2), dropped.metadata)
            time.sleep(0.2)
        assert same(receiver.get(0, 1, key(1), kept.metadata, deadline=deadline(5)), make_payload(1))
        assert not receiver.renew(0, 1, key(1), kept.metadata)  # read: nothing to keep
        # key(2) is not renewed any more: gone within a lease (plus a sweep)
        gone = deadline(lease_s + 5)
        while sender.health()["expired"] < 1:
            assert time.monotonic() < gone, sender.health()
            time.sleep(0.1)
        assert receiver.get(0, 1, key(2), dropped.metadata) is None
        assert not receiver.renew(0, 1, key(2), dropped.metadata)
        assert not receiver.renew(0, 1, key(3), dropped.metadata)  # never put
        assert sender.health()["expired"] == 1
    assert spec.leftovers(token) == []


def test_duplicate_key_is_refused_not_lost(pair):
    sender, receiver = pair
    first = sender.put(0, 1, key(), make_payload(1))
    second = sender.put(0, 1, key(), make_payload(2))
    assert first.ok and not second.ok and second.error
    assert same(receiver.get(0, 1, key(), first.metadata, deadline=deadline(5)), make_payload(1))
    assert sender.health()["put_failures"] == 1
