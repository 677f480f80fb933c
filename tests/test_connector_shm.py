"""SharedMemoryConnector specifics: corrupt segments, crash leftovers, pool reuse."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import threading
import time

import pytest

pytest.register_assert_rewrite("connector_fixtures")
from connector_fixtures import SPECS_BY_NAME, child_put, deadline, key, make_payload, same  # noqa: E402

from vllm_kvbridge.connectors import create_connector  # noqa: E402
from vllm_kvbridge.connectors import shm_segments as seg  # noqa: E402
from vllm_kvbridge.errors import ConfigError, TransferCorrupt  # noqa: E402

pytest_plugins = ["connector_fixtures"]
pytestmark = pytest.mark.forked
SHM = SPECS_BY_NAME["SharedMemoryConnector"]


def _write_segment(token: str, k: str, raw: bytes) -> str:
    path = seg.key_path(token, k)
    with open(path, "wb") as f:
        f.write(raw)
    return path


@pytest.mark.parametrize("case", ["bad_magic", "too_short", "size_past_end", "wrong_key", "garbage_payload"])
def test_corrupt_segment_raises_transfer_corrupt_and_is_removed(token, case):
    header = bytearray(seg.HEADER_SIZE)
    key_raw = key().encode()
    size, k = 64, key()
    if case == "wrong_key":
        key_raw = key(9).encode()
    if case == "size_past_end":
        size = 1 << 30
    fields = (seg.MAGIC, seg.READY, size, 1, os.getpid(), 0, time.time_ns(), len(key_raw), 0)
    seg._HDR.pack_into(header, 0, *fields)
    header[seg._KEY_OFFSET : seg._KEY_OFFSET + len(key_raw)] = key_raw
    if case == "bad_magic":
        header[:8] = b"NOTKVBSH"
    raw = bytes(header[:20]) if case == "too_short" else bytes(header) + b"\x07" * 64
    path = _write_segment(token, k, raw)
    with SHM.make(token) as receiver:
        with pytest.raises(TransferCorrupt):
            receiver.get(0, 1, k, deadline=deadline(2))
        assert receiver.health()["get_failures"] == 1
    assert not os.path.exists(path)
    assert SHM.leftovers(token) == []


def test_crashed_sender_leftovers_are_reaped(token):
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=child_put, args=(SHM.name, token, key(), 1, 1 << 16, out, done, True))
    child.start()
    assert out.get(timeout=60)[0]
    child.join(30)
    assert child.exitcode == 3
    left = SHM.leftovers(token)
    assert any(".p." in n for n in left) and any(".k." in n for n in left)  # the crash left both
    assert sorted(seg.reap_stale(token)) == left
    assert SHM.leftovers(token) == []
    # A live process's segments are left alone (its own TTL reaper owns them).
    with SHM.make(token) as live:
        assert live.put(0, 1, key("live"), make_payload(2)).ok
        names = SHM.leftovers(token)
        assert seg.reap_stale(token) == [] and SHM.leftovers(token) == names and names
    assert SHM.leftovers(token) == []


def test_close_of_a_new_connector_reaps_crash_leftovers(token):
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=child_put, args=(SHM.name, token, key(), 1, 1 << 16, out, done, True))
    child.start()
    assert out.get(timeout=60)[0]
    child.join(30)
    assert SHM.leftovers(token)
    conn = SHM.make(token)
    conn.put(0, 1, key("x"), make_payload(1))  # first use of the namespace reaps
    conn.close()
    assert SHM.leftovers(token) == []


def _get_and_die(token: str, k: str) -> None:
    conn = SHM.make(token)
    held = conn.get(0, 1, k, deadline=deadline(30))
    assert held is not None
    os._exit(5)  # dies holding the segment (state CLAIMED)


def test_segment_held_by_a_dead_receiver_returns_to_the_pool(token):
    ctx = mp.get_context("spawn")
    with SHM.make(token, reap_interval_s=0.05) as sender:
        assert sender.put(0, 1, key(), make_payload(1)).ok
        child = ctx.Process(target=_get_and_die, args=(token, key()))
        child.start()
        child.join(60)
        assert child.exitcode == 5
        end = time.monotonic() + 5
        while sender.health()["pool_free_segments"] != 1 and time.monotonic() < end:
            time.sleep(0.05)
        assert sender.health()["pool_free_segments"] == 1 and sender.health()["lent"] == 0
    assert SHM.leftovers(token) == []


def test_pool_reuses_segments_only_after_the_receiver_releases_them(token):
    with SHM.make(token) as sender, SHM.make(token) as receiver:
        held = []
        for i in range(3):
            assert sender.put(0, 1, key(i), make_payload(i, 1 << 20)).ok
            held.append(receiver.get(0, 1, key(i), deadline=deadline(5)))
        pools = [n for n in SHM.leftovers(token) if ".p." in n]
        assert len(pools) == 3  # each still viewed by the receiver: no reuse
        assert all(same(h, make_payload(i, 1 << 20)) for i, h in enumerate(held))
        del held
        gc.collect()
        for i in range(10):
            assert sender.put(0, 1, key(i + 10), make_payload(i, 1 << 20)).ok
            got = receiver.get(0, 1, key(i + 10), deadline=deadline(5))
            assert same(got, make_payload(i, 1 << 20))
            del got
        assert len([n for n in SHM.leftovers(token) if ".p." in n]) == 3  # no growth
        assert sender.health()["pool_free_segments"] == 3


def test_non_destructive_reads_copy_and_leave_the_segment(token):
    with SHM.make(token) as sender, SHM.make(token, destructive=False) as reader:
        assert sender.put(0, 1, key(), make_payload(4)).ok
        first = reader.get(0, 1, key(), deadline=deadline(5))
        second = reader.get(0, 1, key(), deadline=deadline(5))
        assert same(first, make_payload(4)) and same(second, make_payload(4))
        sender.cleanup(key())
        assert reader.get(0, 1, key()) is None
    assert SHM.leftovers(token) == []


def test_oversize_put_is_refused(token):
    with SHM.make(token, max_payload_bytes=1 << 16) as sender:
        result = sender.put(0, 1, key(), make_payload(1, 1 << 20))
        assert not result.ok and "max_payload_bytes" in result.error
        assert sender.health()["put_failures"] == 1


def test_metadata_namespace_wins_and_names_are_validated(token):
    with SHM.make(token) as sender, create_connector("shm", {}) as receiver:
        result = sender.put(0, 1, key(), make_payload(1))
        assert result.metadata["namespace"] == token
        assert same(receiver.get(0, 1, key(), result.metadata, deadline=deadline(5)), make_payload(1))
        with pytest.raises(ConfigError):
            receiver.get(0, 1, "../etc/passwd")
        with pytest.raises(ConfigError):
            receiver.get(0, 1, key(), {"namespace": "a/b"})
    with pytest.raises(ConfigError):
        create_connector("shm", {"namespace": "bad name"})
    with pytest.raises(ConfigError):
        create_connector("shm", {"ttl_s": -1})


def test_receiver_keeps_the_mapping_of_a_reused_segment(token):
    with SHM.make(token) as sender, SHM.make(token) as receiver:
        for i in range(5):  # same size class: the sender reuses one segment every time
            assert sender.put(0, 1, key(i), make_payload(i, 1 << 20)).ok
            got = receiver.get(0, 1, key(i), deadline=deadline(5))
            assert same(got, make_payload(i, 1 << 20))  # new bytes through the kept mapping
            del got
            gc.collect()
        health = receiver.health()
        assert health["mapped_segments"] == 1 and health["mapped_bytes"] > 1 << 19
        assert len([n for n in SHM.leftovers(token) if ".p." in n]) == 1


def test_kept_mapping_is_dropped_when_the_sender_drops_the_segment(token):
    fds = len(os.listdir("/proc/self/fd"))
    with SHM.make(token, reap_interval_s=0.05) as receiver:
        sender = SHM.make(token)
        assert sender.put(0, 1, key(), make_payload(1)).ok
        held = receiver.get(0, 1, key(), deadline=deadline(5))
        assert receiver.health()["mapped_segments"] == 1
        sender.close()  # unlinks the segment; the receiver still views it
        assert receiver.health()["mapped_segments"] == 1  # busy: kept while viewed
        assert same(held, make_payload(1))
        del held
        gc.collect()
        end = time.monotonic() + 5  # the receiver's reaper notices the segment is gone
        while receiver.health()["mapped_segments"] and time.monotonic() < end:
            time.sleep(0.05)
        assert receiver.health()["mapped_segments"] == 0
    assert SHM.leftovers(token) == []
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_payload_outlives_the_receiver_connector(token):
    with SHM.make(token) as sender:
        receiver = SHM.make(token)
        assert sender.put(0, 1, key(), make_payload(3, 1 << 20)).ok
        held = receiver.get(0, 1, key(), deadline=deadline(5))
        receiver.close()  # forgets the kept mapping; the views keep it mapped
        assert same(held, make_payload(3, 1 << 20))
        del held
        gc.collect()
        end = time.monotonic() + 5  # released: the segment went back to the sender's pool
        while sender.health()["pool_free_segments"] != 1 and time.monotonic() < end:
            time.sleep(0.05)
        assert sender.health()["pool_free_segments"] == 1
    assert SHM.leftovers(token) == []


def test_map_cache_bytes_zero_maps_per_get(token):
    with SHM.make(token) as sender, SHM.make(token, map_cache_bytes=0) as receiver:
        for i in range(3):
            assert sender.put(0, 1, key(i), make_payload(i)).ok
            got = receiver.get(0, 1, key(i), deadline=deadline(5))
            assert same(got, make_payload(i))
            del got
            gc.collect()
        assert receiver.health()["mapped_segments"] == 0
        assert sender.health()["pool_free_segments"] == 1


def test_map_cache_evicts_idle_mappings_only_to_fit_its_budget(token):
    budget = 2 << 20

    def transfer(i: int, nbytes: int) -> dict:
        assert sender.put(0, 1, key(i), make_payload(i, nbytes)).ok
        got = receiver.get(0, 1, key(i), deadline=deadline(5))
        assert same(got, make_payload(i, nbytes))
        del got
        gc.collect()
        health = receiver.health()
        assert health["mapped_bytes"] <= budget
        return health

    with SHM.make(token) as sender, SHM.make(token, map_cache_bytes=budget) as receiver:
        first = transfer(0, 1 << 16)
        assert first["mapped_segments"] == 1
        health = transfer(1, 8 << 20)  # can never fit: mapped per get, evicts nothing
        assert (health["mapped_segments"], health["mapped_bytes"]) == (1, first["mapped_bytes"])
        health = transfer(2, 3 << 19)  # fits next to the first
        assert health["mapped_segments"] == 2
        health = transfer(3, 2 << 20)  # fits only alone: both idle ones go
        assert health["mapped_segments"] == 1 and health["mapped_bytes"] > 1 << 19


def test_get_sees_a_payload_published_while_it_polls(token):
    with SHM.make(token) as sender, SHM.make(token) as receiver:
        timer = threading.Timer(0.2, lambda: sender.put(0, 1, key(), make_payload(5)))
        timer.start()
        try:
            got = receiver.get(0, 1, key(), deadline=deadline(10))
        finally:
            timer.join()
        assert same(got, make_payload(5))


def _get_in_thread(receiver) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append(receiver.get(0, 1, key(), deadline=deadline(60))))
    t.start()
    return t, got


def test_a_waiting_get_is_woken_by_the_publish_not_a_timer(token, monkeypatch):
    """The get sleeps on an inotify watch of /dev/shm (it calls the watch's wait, not a
    timer): with the watch's retry set beyond the test's guards, only the link of the key
    can wake it."""
    from vllm_kvbridge.connectors import dir_watch

    monkeypatch.setattr(dir_watch, "RETRY_S", 600.0)
    waits = threading.Semaphore(0)
    real_wait = dir_watch.DirWatch.wait

    def counted_wait(self, name, timeout):
        waits.release()
        return real_wait(self, name, timeout)

    monkeypatch.setattr(dir_watch.DirWatch, "wait", counted_wait)
    with SHM.make(token) as sender, SHM.make(token) as receiver:
        t, got = _get_in_thread(receiver)
        assert waits.acquire(timeout=30), "the get never slept on its watch"
        # Another name in the directory wakes the watch but not the get: it sleeps again.
        assert sender.put(0, 1, key(99), make_payload(9)).ok
        assert waits.acquire(timeout=30) and t.is_alive()
        assert sender.put(0, 1, key(), make_payload(5)).ok
        t.join(30)
        assert not t.is_alive() and same(got[0], make_payload(5))
        sender.cleanup(key(99))


def test_without_inotify_a_waiting_get_polls(token, monkeypatch):
    from vllm_kvbridge.connectors import dir_watch

    monkeypatch.setattr(dir_watch.DirWatch, "open", classmethod(lambda cls, d: None))
    with SHM.make(token) as sender, SHM.make(token) as receiver:
        t, got = _get_in_thread(receiver)
        time.sleep(0.05)  # (either order must deliver: before or during the get's polling)
        assert sender.put(0, 1, key(), make_payload(6)).ok
        t.join(30)
        assert not t.is_alive() and same(got[0], make_payload(6))


def test_a_zombie_owners_segments_are_reaped(token) -> None:
    """Containers whose PID 1 does not reap orphans keep a killed worker as a zombie; its
    segments must still count as dead (its files, and so its owner locks, are closed)."""
    pid = os.fork()
    if pid == 0:
        try:
            conn = SHM.make(token)
            conn.put(0, 1, key(), make_payload(1))
        finally:
            os._exit(0)  # no close(): the names stay, as after a crash
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end:  # exits, stays a zombie (no wait yet)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.01)
        assert len(seg.list_names(token)) == 2  # its pool name and published key
        # The kernel drops a dead process's locks as it tears down its files and mappings,
        # which may finish a moment after the zombie state shows: poll, bounded.
        removed: list[str] = []
        while len(removed) < 2 and time.monotonic() < end:
            removed += seg.reap_stale(token)
            time.sleep(0.01)
        assert len(removed) == 2 and seg.list_names(token) == []
        assert os.waitpid(pid, os.WNOHANG)[0] == pid, "the child must still have been a zombie"
    finally:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def test_default_namespaces_of_edges_sharing_a_dash_differ():
    # Issue 11, case 6: "<from>-<to>" made edges ("a-b", "c") and ("a", "b-c") one namespace.
    with create_connector("shm", {}) as conn:
        assert conn.namespace("a-b", "c") != conn.namespace("a", "b-c")
        assert conn.namespace(0, 1) == "0-1"
        long_a, long_b = "a-" * 16, "-b" * 16
        assert conn.namespace(long_a, long_b) != conn.namespace(long_b, long_a)  # hashed, still distinct


def test_a_segment_whose_receiver_died_while_claiming_is_taken_back(token):
    """Issue 11, case 10: a receiver that renamed a key to its claim name and died before
    opening it left the segment READY in the sender's lent list forever (and its claim
    name in /dev/shm)."""
    with SHM.make(token, ttl_s=0.2, reap_interval_s=0.05, claim_grace_s=0.3) as sender:
        result = sender.put(0, 1, key(1), make_payload(1))
        assert result.ok
        # What a receiver does first when it claims; then it "dies".
        claim_name = os.path.join(seg.SHM_DIR, f"{seg.PREFIX}.{token}.c.999999.dead0")
        os.rename(seg.key_path(token, key(1)), claim_name)
        end = time.monotonic() + 10
        while time.monotonic() < end and (sender.health()["lent"] or os.path.exists(claim_name)):
            time.sleep(0.05)
        assert sender.health()["lent"] == 0 and not os.path.exists(claim_name)
        pool = [n for n in seg.list_names(token) if ".p." in n]
        assert sender.put(0, 1, key(2), make_payload(1)).ok  # the segment is reused
        assert [n for n in seg.list_names(token) if ".p." in n] == pool


def test_a_close_during_a_reserve_leaves_no_segment(token, monkeypatch):
    """A reserve makes its new pool segment outside the connector's lock; a close() that
    runs meanwhile must not leave that segment in /dev/shm (the reserve fails as closed)."""
    from vllm_kvbridge.connectors import shm as shm_module
    from vllm_kvbridge.errors import ConnectorClosed

    conn = SHM.make(token)
    real_segment = shm_module.seg.PoolSegment

    def segment_then_close(*args, **kwargs):  # close() runs while the segment is being made
        segment = real_segment(*args, **kwargs)
        conn.close()
        return segment

    monkeypatch.setattr(shm_module.seg, "PoolSegment", segment_then_close)
    with pytest.raises(ConnectorClosed):
        conn.reserve(0, 1, key(), 1 << 16)
    assert SHM.leftovers(token) == []
