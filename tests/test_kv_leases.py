"""Receiver-side leases (issue 11 case 11, issue 15 item 3) through two real KV managers.

A sender's KV nobody read is dropped ``ttl_s`` after the put. A consumer whose queue is
longer than that holds leases on what its queued requests will read
(:meth:`KVTransferManager.hold_leases`): that KV outlives the TTL, bit-exact, while a
request it stopped holding (and one it never held) is dropped, counted as expired. Real
shared-memory connectors; the margins are a 2 s lease renewed every 1/3 s against a
0.5 s TTL.
"""

from __future__ import annotations

import os
import time

import pytest
from kv_fixtures import BLOCK, fake_cpu_caches, reference_kv, request_plan

from vllm_kvbridge.errors import TransferTimeout
from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.leases import announced_keys
from vllm_kvbridge.kv.manager import KVTransferManager

TTL_S, LEASE_S = 0.5, 2.0
NS = "kvtestlease"


def _managers() -> tuple[KVTransferManager, KVTransferManager]:
    conn = {"namespace": NS, "ttl_s": TTL_S, "lease_s": LEASE_S}
    send = KVTransferConfig(
        need_send_cache=True, stage_id=0, to_stage=1, connector="SharedMemoryConnector", connector_config=conn
    )
    recv = KVTransferConfig(
        need_recv_cache=True,
        stage_id=1,
        from_stage=0,
        connector="SharedMemoryConnector",
        connector_config=conn,
        recv_timeout=1.0,
    )
    return KVTransferManager(send, num_kv_heads=2), KVTransferManager(recv, num_kv_heads=2)


@pytest.mark.forked
def test_held_kv_outlives_the_ttl_and_released_kv_expires_within_a_lease() -> None:
    caches = fake_cpu_caches(2, 6)
    sender, receiver = _managers()
    with sender, receiver:
        rids = ["queued", "released", "never-held"]
        sender.handle_finished_requests_kv_transfer(
            {rid: request_plan(i) for i, rid in enumerate(rids)}, caches, BLOCK, "auto"
        )
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while done != set(rids) and time.monotonic() < deadline:
            done |= sender.get_finished()[0]
            time.sleep(0.01)
        assert done == set(rids)
        info = {rid: sender.get_sender_info(rid) for rid in rids}
        assert all(announced_keys(i) for i in info.values())
        assert receiver.hold_leases("queued", info["queued"]) == len(announced_keys(info["queued"]))
        assert receiver.hold_leases("released", info["released"]) > 0
        time.sleep(4 * TTL_S)  # the queue in front of them: four TTLs
        receiver.release_leases("released")
        data, _ = receiver.receive_kv_cache_for_request("queued", sender_info=info["queued"])
        assert data is not None and data.seq_len == request_plan(0)["seq_len"]
        keys, values = reference_kv(caches, request_plan(0))
        assert all((g == w).all() for g, w in zip(data.key_cache, keys))
        assert all((g == w).all() for g, w in zip(data.value_cache, values))
        receiver.release_leases("queued")
        with pytest.raises(TransferTimeout):  # dropped at its TTL: nobody held it
            receiver.receive_kv_cache_for_request("never-held", sender_info=info["never-held"])
        expired = lambda: sender.connector.health()["expired"]  # noqa: E731
        end = time.monotonic() + LEASE_S + 5
        while expired() < 2 and time.monotonic() < end:  # "released": one lease after its last renewal
            time.sleep(0.1)
        assert expired() == 2, sender.connector.health()
        with pytest.raises(TransferTimeout):
            receiver.receive_kv_cache_for_request("released", sender_info=info["released"])
        leases = receiver.health()["leases"]
        assert leases["held_requests"] == 0 and leases["renewals"] >= 2 * 4 and leases["errors"] == 0
    assert [n for n in os.listdir("/dev/shm") if NS in n] == []
