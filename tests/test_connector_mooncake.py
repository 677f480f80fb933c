"""MooncakeStoreConnector against a real ``mooncake_master`` on loopback.

The shared contract suite (``test_connector_contract.py``) covers the common semantics;
this module covers what is specific to the store: zero-copy paths, keys left in the
store, pinning and a full store, the master going away and coming back, unreachable
masters at construction, config parsing.
"""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from mooncake_fixtures import MooncakeMaster, free_port

from vllm_kvbridge.config import resolve
from vllm_kvbridge.connectors import create_connector, payload_key
from vllm_kvbridge.connectors.base import edge_counters, parse_size
from vllm_kvbridge.connectors.mooncake_store import MooncakeStoreConnector
from vllm_kvbridge.errors import ConfigError, TransferCorrupt, TransferError, TransferRefused, TransferTimeout

pytest_plugins = ["mooncake_fixtures"]
# slow: a mooncake_master per test, ~100 s in all; the contract suite keeps the store in make test-quick
pytestmark = [pytest.mark.forked, pytest.mark.mooncake, pytest.mark.slow]

NS = "mctest"
STAGE_CONFIGS = Path(__file__).resolve().parent.parent / "stage_configs"


def key(i: int | str = 0) -> str:
    return payload_key(f"req{i}", 0, 1)


def payload(seed: int, n: int = 1 << 16) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(n, generator=gen), "ids": torch.arange(seed, seed + 5), "name": f"p{seed}"}


def same(a: dict, b: dict) -> bool:
    return torch.equal(a["k"], b["k"]) and torch.equal(a["ids"], b["ids"]) and a["name"] == b["name"]


def soon(seconds: float) -> float:
    return time.monotonic() + seconds


def test_zero_copy_roundtrip_consumes_the_key(mooncake_master: MooncakeMaster):
    with (
        create_connector("mooncake", mooncake_master.connector_config(namespace=NS)) as sender,
        MooncakeStoreConnector(
            mooncake_master.connector_config(namespace=NS, global_segment_size=0)
        ) as receiver,
    ):
        assert sender.zero_copy and receiver.zero_copy
        result = sender.put(0, 1, key(), payload(1))
        assert result.ok and result.metadata["key"] == f"{NS}/{key()}"
        assert result.metadata["nbytes"] == result.nbytes and result.metadata["namespace"] == NS
        assert mooncake_master.keys(NS) == [f"{NS}/{key()}"]
        got = receiver.get(0, 1, key(), result.metadata, deadline=soon(10))
        assert same(got, payload(1))
        # Both tensors are views of the one received buffer (zero copy after get_into).
        base = got["k"].untyped_storage().data_ptr()
        assert base - 4096 < got["ids"].untyped_storage().data_ptr() < base + result.nbytes
        assert mooncake_master.keys(NS) == []  # destructive read
        health = receiver.health()
        assert health["gets"] == 1 and health["master"] == mooncake_master.master_address
        assert health["master_reachable"] is True and health["local_hostname"].startswith("127.0.0.1:")
        assert sender.health()["local_hostname"] != health["local_hostname"]  # one port per client


def test_a_stream_of_transfers_reuses_one_registered_slab_each_side(mooncake_master: MooncakeMaster):
    """Issue 37: every put kept its registered slab (a published reservation was never
    given back: 128 MB more registered memory per 64 MB put, faulted in afresh) and every
    get registered a fresh buffer; both made a 64 MB transfer 4-5x slower than Mooncake's
    own. A steady stream now registers one slab per side, and a slab comes back once the
    tensors read into it are gone (while they live, it stays lent)."""
    with (
        MooncakeStoreConnector(mooncake_master.connector_config(namespace=NS)) as sender,
        MooncakeStoreConnector(
            mooncake_master.connector_config(namespace=NS, global_segment_size=0)
        ) as receiver,
    ):
        for i in range(5):
            result = sender.put(0, 1, key(i), payload(i, 1 << 20))
            assert result.ok
            assert sender.health()["buffers_lent"] == 0  # back to the pool once stored
            got = receiver.get(0, 1, key(i), result.metadata, deadline=soon(10))
            assert same(got, payload(i, 1 << 20))
            assert receiver.health()["buffers_lent"] == 1  # the tensors view the slab
            del got
            gc.collect()
            assert receiver.health()["buffers_lent"] == 0
        assert sender.health()["buffer_registrations"] == 1
        assert receiver.health()["buffer_registrations"] == 1


def test_bytes_fallback_roundtrip(mooncake_master: MooncakeMaster):
    cfg = mooncake_master.connector_config(namespace=NS, zero_copy=False)
    with MooncakeStoreConnector(cfg) as sender, MooncakeStoreConnector(cfg) as receiver:
        assert not sender.zero_copy
        result = sender.put(0, 1, key(), payload(2, 1 << 18))
        assert result.ok
        assert same(receiver.get(0, 1, key(), result.metadata, deadline=soon(10)), payload(2, 1 << 18))
    assert mooncake_master.keys(NS) == []


def test_env_is_expanded_when_the_stage_config_loads_not_by_the_connector(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
):
    # The shipped Mooncake stage config, resolved with the test master in its variables:
    # every connector config the stages get is plain (nothing left for a transport to expand).
    monkeypatch.setenv("KVB_MOONCAKE_MASTER", mooncake_master.master_address)
    monkeypatch.setenv("KVB_MOONCAKE_METADATA", mooncake_master.metadata_server)
    monkeypatch.setenv("KVB_MOONCAKE_SEGMENT", "64MiB")
    plan = resolve(STAGE_CONFIGS / "ar_to_dit_mooncake.yaml")
    configs = [e.connector.config for s in plan.stages for e in (*s.inputs, *s.outputs)]
    assert configs and "${" not in json.dumps(configs)
    sender_cfg = plan.stage(0).outputs[0].connector.config
    assert sender_cfg["master_server_address"] == mooncake_master.master_address
    with MooncakeStoreConnector({**sender_cfg, "namespace": "fromcfg"}) as conn:
        assert conn.global_segment_size == 64 << 20
        assert conn.put(0, 1, key(), payload(0)).ok
        assert mooncake_master.keys("fromcfg/") == [f"fromcfg/{key()}"]
    assert mooncake_master.keys() == []
    # Handed an unexpanded reference, the connector takes it literally: a clear config error.
    with pytest.raises(ConfigError, match=r"master_server_address must be 'host:port'.*\$\{KVB_MOONCAKE"):
        MooncakeStoreConnector({"master_server_address": "${KVB_MOONCAKE_MASTER}"})


@pytest.mark.parametrize(
    "bad",
    [
        {"protocol": "udp"},
        {"namespace": "a/b"},
        {"global_segment_size": "lots"},
        {"pin": "maybe"},
        {"ttl_s": -1},
        {"master_server_address": "nohost"},
    ],
)
def test_bad_config_is_a_config_error(bad: dict):
    with pytest.raises(ConfigError):
        MooncakeStoreConnector({"master_server_address": "127.0.0.1:1", **bad})


def test_parse_size():
    assert parse_size("1GiB", "x") == 1 << 30 and parse_size("512MB", "x") == 512 * 10**6
    assert parse_size(4096, "x") == 4096 and parse_size("7", "x") == 7 and parse_size("2 kib", "x") == 2048


def test_unreachable_master_is_a_clear_error_quickly():
    port = free_port()  # nobody listens there
    start = time.monotonic()
    with pytest.raises(TransferError, match=f"master at 127.0.0.1:{port} is unreachable"):
        MooncakeStoreConnector(
            {
                "master_server_address": f"127.0.0.1:{port}",
                "metadata_server": f"http://127.0.0.1:{free_port()}/metadata",
            }
        )
    assert time.monotonic() - start < 3


def test_unreachable_metadata_server_is_a_clear_error(mooncake_master: MooncakeMaster):
    port = free_port()
    with pytest.raises(TransferError, match="metadata server"):
        MooncakeStoreConnector(
            mooncake_master.connector_config(metadata_server=f"http://127.0.0.1:{port}/metadata")
        )


def test_master_that_never_answers_times_out_setup(mooncake_master: MooncakeMaster):
    # Something accepts TCP on the "master" port but never speaks Mooncake's RPC: setup
    # would block (holding the GIL); setup_check=subprocess gives up after connect_timeout_s.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(TransferError, match="did not finish within connect_timeout_s"):
            MooncakeStoreConnector(
                mooncake_master.connector_config(
                    master_server_address=address, connect_timeout_s=1.5, setup_check="subprocess"
                )
            )
        assert time.monotonic() - start < 5
    # ...while against the real master the check passes and the connector works
    with MooncakeStoreConnector(
        mooncake_master.connector_config(namespace=NS, setup_check="subprocess")
    ) as conn:
        assert conn.put(0, 1, key(), payload(1)).ok
        assert same(conn.get(0, 1, key(), deadline=soon(5)), payload(1))


def test_master_killed_mid_run_then_restarted(mooncake_master: MooncakeMaster):
    cfg = mooncake_master.connector_config(namespace=NS, master_retry_s=1.0)
    with MooncakeStoreConnector(cfg) as sender, MooncakeStoreConnector(cfg) as receiver:
        assert sender.put(0, 1, key("before"), payload(1)).ok
        errors: list[BaseException] = []
        finished = threading.Event()

        def pending_get() -> None:
            try:
                receiver.get(0, 1, key("never"), {"namespace": NS}, deadline=soon(60))
            except BaseException as exc:
                errors.append(exc)
            finished.set()

        waiter = threading.Thread(target=pending_get)
        waiter.start()
        time.sleep(0.3)
        mooncake_master.kill()
        killed_at = time.monotonic()
        assert finished.wait(15), "a get pending on a dead master must fail in bounded time"
        waiter.join()
        assert time.monotonic() - killed_at < 10
        assert len(errors) == 1 and type(errors[0]) is TransferError, errors
        assert "unreachable" in str(errors[0]) and mooncake_master.master_address in str(errors[0])
        # a put while the master is down fails cleanly too
        start = time.monotonic()
        down = sender.put(0, 1, key("down"), payload(2))
        assert not down.ok and "master" in down.error and time.monotonic() - start < 10
        assert sender.health()["master_reachable"] is False
        # what the stage reports to the pipeline (/health degraded, kvbridge_edge_unreachable)
        assert edge_counters([sender.health()])["edges_unreachable"] == 1

        mooncake_master.start()  # same ports: clients reconnect by themselves
        until = soon(20)
        while not (sender.health()["master_reachable"] and receiver.health()["master_reachable"]):
            assert time.monotonic() < until, "clients did not reconnect to the restarted master"
            time.sleep(0.1)
        assert edge_counters([sender.health(), receiver.health()])["edges_unreachable"] == 0
        result = None
        while result is None or not result.ok:  # segments are re-mounted shortly after reconnecting
            assert time.monotonic() < until, result
            result = sender.put(0, 1, key("after"), payload(3))
            time.sleep(0.05)
        assert same(receiver.get(0, 1, key("after"), result.metadata, deadline=soon(10)), payload(3))
    assert mooncake_master.keys() == []


def test_store_full_put_is_answered_full_without_evicting(mooncake_master: MooncakeMaster):
    """A full store refuses a put as ``full`` (the sender waits for room: issue 15 item 2),
    never by evicting an unread payload; once one is read, the same put lands."""
    cfg = mooncake_master.connector_config(namespace=NS, global_segment_size=16 << 20)  # Mooncake's minimum
    with (
        MooncakeStoreConnector(cfg) as sender,
        MooncakeStoreConnector({**cfg, "global_segment_size": 0}) as receiver,
    ):
        n = (6 << 20) // 4  # ~6 MiB each: two fit, the third does not
        results = [sender.put(0, 1, key(i), payload(i, n)) for i in range(3)]
        assert [r.ok for r in results] == [True, True, False]
        assert results[2].full and "store full" in results[2].error
        assert sender.health()["put_full"] == 1 and sender.health()["put_failures"] == 0
        for i in range(2):  # hard-pinned (default): the unread payloads were not evicted to make room
            assert same(receiver.get(0, 1, key(i), results[i].metadata, deadline=soon(10)), payload(i, n))
        assert sender.put(0, 1, key(2), payload(2, n)).ok  # room again once consumed
        assert receiver.get(0, 1, key(2), {"namespace": NS}, deadline=soon(10)) is not None
    assert mooncake_master.keys() == []


def test_unread_key_is_removed_by_ttl(mooncake_master: MooncakeMaster):
    with MooncakeStoreConnector(mooncake_master.connector_config(namespace=NS, ttl_s=0.3)) as sender:
        assert sender.put(0, 1, key(), payload(1)).ok
        assert mooncake_master.keys(NS) == [f"{NS}/{key()}"]
        until = soon(5)
        while mooncake_master.keys(NS):
            assert time.monotonic() < until, "the reaper did not remove the unread key"
            time.sleep(0.05)
        assert sender.health()["published"] == 0


def test_renew_needs_a_live_sender_and_its_control_endpoint(mooncake_master: MooncakeMaster):
    """A renewal goes to the sender's control server: once the sender closed (its endpoint
    is gone) it raises TransferError within its bound; put metadata without a control
    endpoint (an older sender) renews nothing."""
    cfg = mooncake_master.connector_config(namespace=NS)
    with MooncakeStoreConnector({**cfg, "global_segment_size": 0}) as receiver:
        sender = MooncakeStoreConnector(cfg)
        result = sender.put(0, 1, key(), payload(1))
        assert result.ok and result.metadata["control"].startswith("tcp://")
        assert receiver.renew(0, 1, key(), result.metadata) is True
        old = {k: v for k, v in result.metadata.items() if k != "control"}
        assert receiver.renew(0, 1, key(), old) is False
        sender.close()
        start = time.monotonic()
        with pytest.raises(TransferError):
            receiver.renew(0, 1, key(), result.metadata)
        assert time.monotonic() - start < 5
        assert receiver.renew(0, 1, key(), old) is False
    assert mooncake_master.keys() == []


def test_two_receivers_reading_one_object_only_one_gets_it(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
):
    """Issue 11 case 13: a store read is not atomic with its removal. Receiver A has read
    the object but not removed it yet when receiver B reads and removes it: only B's get
    returns it (a destructive get is read once); A's finds it gone, counted."""
    from vllm_kvbridge.connectors import mooncake_store

    cfg = mooncake_master.connector_config(namespace=NS)
    with (
        create_connector("mooncake", cfg) as sender,
        MooncakeStoreConnector({**cfg, "global_segment_size": 0}) as a,
        MooncakeStoreConnector({**cfg, "global_segment_size": 0}) as b,
    ):
        result = sender.put(0, 1, key(), payload(1))
        assert result.ok
        real_read, got_b = mooncake_store.read_object, []

        def read_then_b(store, store_key, size, pool):  # type: ignore[no-untyped-def]
            got = real_read(store, store_key, size, pool)
            if store is a._store and not got_b:  # A has its bytes; B takes the object now
                got_b.append(b.get(0, 1, key(), result.metadata))
            return got

        monkeypatch.setattr(mooncake_store, "read_object", read_then_b)
        assert a.get(0, 1, key(), result.metadata) is None
        assert len(got_b) == 1 and same(got_b[0], payload(1))
        assert a.health()["read_lost_to_another"] == 1 and b.health().get("read_lost_to_another", 0) == 0
        assert not a._store.is_exist(result.metadata["key"])


def test_cleanup_and_close_remove_keys_from_the_store(mooncake_master: MooncakeMaster):
    cfg = mooncake_master.connector_config(namespace=NS)
    sender, receiver = MooncakeStoreConnector(cfg), MooncakeStoreConnector(cfg)
    for i in range(4):
        assert sender.put(0, 1, key(i), payload(i)).ok
    receiver.cleanup(key(0))  # a receiver giving up on a transfer removes it for everyone
    sender.cleanup(key(1))
    sender.cleanup(key(1))
    assert mooncake_master.keys(NS) == [f"{NS}/{key(2)}", f"{NS}/{key(3)}"]
    assert receiver.get(0, 1, key(0), {"namespace": NS}) is None
    receiver.close()
    sender.close()  # removes the two it still tracks
    sender.cleanup(key(2))  # after close: no-op, no error
    assert mooncake_master.keys() == []
    assert mooncake_master.metric("master_key_count") == 0


def test_same_key_from_two_senders_is_refused(mooncake_master: MooncakeMaster):
    cfg = mooncake_master.connector_config(namespace=NS)
    with MooncakeStoreConnector(cfg) as a, MooncakeStoreConnector(cfg) as b:
        assert a.put(0, 1, key(), payload(1)).ok
        second = b.put(0, 1, key(), payload(2))
        assert not second.ok and "already exists" in second.error
        assert same(b.get(0, 1, key(), {"namespace": NS}, deadline=soon(5)), payload(1))
    assert mooncake_master.keys() == []


def test_oversized_object_is_refused_and_removed(mooncake_master: MooncakeMaster):
    cfg = mooncake_master.connector_config(namespace=NS)
    with (
        MooncakeStoreConnector(cfg) as sender,
        MooncakeStoreConnector({**cfg, "max_payload_bytes": 1 << 16}) as receiver,
    ):
        assert not receiver.put(0, 1, key(9), payload(9, 1 << 16)).ok  # over its own limit too
        result = sender.put(0, 1, key(), payload(1, 1 << 16))
        with pytest.raises(TransferRefused, match="max_payload_bytes"):
            receiver.get(0, 1, key(), result.metadata, deadline=soon(5))
        assert mooncake_master.keys(NS) == []
        assert receiver.health()["get_failures"] == 1


def test_corrupt_object_raises_and_is_removed(mooncake_master: MooncakeMaster):
    with MooncakeStoreConnector(mooncake_master.connector_config(namespace=NS)) as conn:
        assert conn._store.put(conn.store_key(key()), b"not a kvbridge payload") == 0
        with pytest.raises(TransferCorrupt, match="does not decode"):
            conn.get(0, 1, key(), deadline=soon(5))
        assert mooncake_master.keys() == []


def test_an_object_not_ready_yet_is_a_timeout_until_master_retry_s(mooncake_master: MooncakeMaster):
    """``REPLICA_IS_NOT_READY`` (a put still writing the object) at a get's deadline is "not
    there yet" (TransferTimeout, which the KV manager's sliced receive asks again for), not a
    failure; only after ``master_retry_s`` of it is the get a TransferError."""
    from vllm_kvbridge.connectors.mooncake_setup import REPLICA_IS_NOT_READY

    class NotReady:  # the real store, whose get_size answers "not ready" while `writing` is set
        def __init__(self, store):
            self.store, self.writing = store, threading.Event()

        def get_size(self, store_key):
            return REPLICA_IS_NOT_READY if self.writing.is_set() else self.store.get_size(store_key)

        def __getattr__(self, name):
            return getattr(self.store, name)

    config = mooncake_master.connector_config(namespace=NS, master_retry_s=1.0)
    with create_connector("mooncake", config) as sender, MooncakeStoreConnector(config) as receiver:
        result = sender.put(0, 1, key(), payload(7))
        store = NotReady(receiver._store)
        receiver._store = store
        store.writing.set()
        with pytest.raises(TransferTimeout, match="REPLICA_IS_NOT_READY"):
            receiver.get(0, 1, key(), result.metadata, deadline=soon(0.2))
        store.writing.clear()
        assert same(receiver.get(0, 1, key(), result.metadata, deadline=soon(5)), payload(7))
        assert sender.put(0, 1, key(2), payload(8)).ok
        store.writing.set()
        with pytest.raises(TransferError, match="transient errors") as failed:
            receiver.get(0, 1, key(2), result.metadata, deadline=soon(5))
        assert not isinstance(failed.value, TransferTimeout)


def test_get_deadline_and_bad_metadata(mooncake_master: MooncakeMaster):
    with MooncakeStoreConnector(mooncake_master.connector_config(namespace=NS)) as conn:
        start = time.monotonic()
        with pytest.raises(TransferTimeout, match="did not appear"):
            conn.get(0, 1, key(), deadline=start + 0.3)
        assert 0.3 <= time.monotonic() - start < 2
        with pytest.raises(TransferError, match="invalid namespace"):
            conn.get(0, 1, key(), {"namespace": "../x"})
        with pytest.raises(ConfigError):
            conn.put(0, 1, "", payload(0))


_SPILLING_SENDER = """
import json, sys, time
import torch
from vllm_kvbridge.connectors.mooncake_store import MooncakeStoreConnector
sender = MooncakeStoreConnector(json.loads(sys.argv[1]))
for i in range(4):  # 10 MiB each into a 16 MiB own segment: the last three land elsewhere
    assert sender.put(0, 1, f"kvb.0-1.kv.idead{i}.cn.r0-0", {"t": torch.full((10 << 18,), float(i))}).ok
print(int(sender.health()["spilled"]), flush=True)
time.sleep(300)  # killed by the test
"""


@pytest.mark.slow
def test_a_killed_senders_objects_do_not_outlive_it(tmp_path: Path):
    """Issue 11, case 13. A sender whose own segment is full has its puts placed in another
    client's segment, where a hard pin would keep them after the sender is killed, for as
    long as that client lives. What stays in its own segment goes with it (the master drops
    a dead client's segment after ``--client_ttl``); the spilled objects were stored
    soft-pinned, so the store evicts them when it needs the room, and new puts succeed."""
    import signal
    import subprocess
    import sys

    ns = "spill"
    with MooncakeMaster(log_dir=tmp_path, extra_args=("-client_ttl=2",)) as master:
        holder = MooncakeStoreConnector(master.connector_config(namespace=ns, global_segment_size=96 << 20))
        cfg = master.connector_config(namespace=ns, global_segment_size=16 << 20, buffer_pool_bytes=64 << 20)
        child = subprocess.Popen(
            [sys.executable, "-c", _SPILLING_SENDER, json.dumps(cfg)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "3"  # three puts spilled into the holder
            dead = [f"{ns}/kvb.0-1.kv.idead{i}.cn.r0-0" for i in range(4)]
            assert master.keys(f"{ns}/kvb.0-1.kv.idead") == dead
            child.send_signal(signal.SIGKILL)  # nothing of the sender's runs any more
            child.wait(10)
            end = time.monotonic() + 30
            while dead[0] in master.keys(ns) and time.monotonic() < end:
                time.sleep(0.2)
            assert master.keys(f"{ns}/kvb.0-1.kv.idead") == dead[1:]  # the own segment went
            # The holder needs its segment back: 8 more objects fit only once all three are gone
            # (nine of them do not fit its 96 MiB).
            stored = 0
            end = time.monotonic() + 60
            while stored < 8 and time.monotonic() < end:
                if holder.put(0, 1, f"kvb.0-1.kv.inew{stored}.cn.r0-0", {"t": torch.ones(10 << 18)}).ok:
                    stored += 1
                else:
                    time.sleep(0.2)  # the master evicts in the background
            assert stored == 8, f"store full: the dead sender's objects {master.keys(ns)} were never evicted"
            assert master.keys(f"{ns}/kvb.0-1.kv.idead") == []
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
            holder.close()
