"""Runtime layer and KV sender without an engine: in-flight KV sends, release at process
exit, and reaping of what a killed process left (real connectors, threads, processes)."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch
from kv_fixtures import BLOCK, fake_cpu_caches, reference_kv, request_plan
from runner_fixtures import (
    exit_without_shutdown_child,
    killed_sender_child,
    payload_producer_settings,
    shm_entries,
    shm_namespace,
)

from vllm_kvbridge.connectors.registry import create_connector, register_connector
from vllm_kvbridge.connectors.shm import SharedMemoryConnector
from vllm_kvbridge.errors import TransferCorrupt
from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.manager import KVTransferManager
from vllm_kvbridge.runner.kv_sender import WorkerKVSender
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.stage_runtime import reap_stage_leftovers
from vllm_kvbridge.runner.vllm_connector import KVSendSpec

pytestmark = pytest.mark.forked


class _GatedShm(SharedMemoryConnector):
    """A real shared-memory connector whose publishes wait until ``gate`` is set (a slow network)."""

    name = "GatedShm"
    gate = threading.Event()

    def _publish_lent(self, reservation, start):  # puts and the KV sender's publishes
        if not type(self).gate.wait(30):
            raise TimeoutError("gate never opened")
        return super()._publish_lent(reservation, start)


register_connector("GatedShm", _GatedShm, replace=True)


def _wait(pred, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.01)


def _kvbridge_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvbridge-"))


@pytest.mark.parametrize("aborted", [False, True])
def test_request_ended_while_its_kv_send_is_in_flight_reads_pending_until_the_send_completes(
    aborted: bool,
) -> None:
    ns = shm_namespace("gate")
    caches, plan = fake_cpu_caches(2, 3), request_plan(5)
    settings = RunnerSettings.from_dict(
        {
            "stage_id": 0,
            "kv_transfer": {
                "need_send_cache": True,
                "to_stage": 1,
                "connector": "GatedShm",
                "connector_config": {"namespace": ns},
            },
        }
    )
    sender = WorkerKVSender(settings, caches, None, num_kv_heads=2, block_size=BLOCK)
    _GatedShm.gate.clear()
    try:
        spec = KVSendSpec("eng-1", "user-1", (tuple(plan["block_ids"]),), plan["seq_len"], release=True)
        sender.send([spec])  # gathers now: the blocks may be reused once it returns
        if aborted:
            sender.mark_aborted({"eng-1": "user-1"})
        time.sleep(0.2)  # the I/O thread is now blocked in the put
        assert sender.pending() == 1
        assert sender.status(["user-1", "eng-1"]) == {
            rid: {"kv": "pending", "aborted": str(aborted).lower()} for rid in ("user-1", "eng-1")
        }
        caches[0].fill_(-1.0)  # what the gather copied is what leaves, whatever the cache holds now
        _GatedShm.gate.set()
        _wait(lambda: sender.status(["user-1"])["user-1"]["kv"] == "done")
        assert sender.pending() == 0
        assert sender.status(["user-1"])["user-1"] == {"kv": "done", "aborted": str(aborted).lower()}
        assert sender.status(["never-sent"])["never-sent"]["kv"] == "unknown"
        sender.mark_aborted({"eng-1": "user-1"})  # an abort after the send settled is recorded too
        assert sender.status(["user-1"])["user-1"] == {"kv": "done", "aborted": "true"}
        # The KV that left is whole.
        info = sender.sender_info(["user-1"])["user-1"]
        recv = KVTransferConfig(
            need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=5, connector_config={"namespace": ns}
        )
        keys, values = reference_kv(fake_cpu_caches(2, 3), plan)
        with KVTransferManager(recv) as receiver:
            data, _ = receiver.receive_kv_cache_for_request("user-1", sender_info=info)
            assert all(torch.equal(a, b) for a, b in zip(data.key_cache, keys))
            assert all(torch.equal(a, b) for a, b in zip(data.value_cache, values))
            del data
    finally:
        _GatedShm.gate.set()
        sender.shutdown()
    assert _kvbridge_threads() == []
    assert shm_entries(ns) == []


def test_the_senders_kv_declaration_is_checked_by_the_receiver() -> None:
    """Issue 15, item 4: every put declares model, dtype, layers, heads and head dim; a
    receiver that expects another model fails the request naming both, one that expects
    what was sent gets the KV."""
    ns = shm_namespace("decl")
    caches, plan = fake_cpu_caches(2, 3), request_plan(5)
    settings = RunnerSettings.from_dict(
        {
            "stage_id": 0,
            "kv_transfer": {"need_send_cache": True, "to_stage": 1, "connector_config": {"namespace": ns}},
        }
    )
    sender = WorkerKVSender(settings, caches, None, num_kv_heads=2, block_size=BLOCK, model="tiny-llama")
    assert {k: sender.kv_spec[k] for k in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim")} == {
        "model": "tiny-llama",
        "dtype": "float32",
        "num_layers": len(caches),
        "num_kv_heads": 2,
        "head_dim": caches[0].shape[-1] // 2,
    }
    try:
        for rid in ("good", "bad"):
            sender.send(
                [KVSendSpec(f"e-{rid}", rid, (tuple(plan["block_ids"]),), plan["seq_len"], release=True)]
            )
        _wait(lambda: all(s["kv"] == "done" for s in sender.status(["good", "bad"]).values()))
        for rid, expect in (
            ("good", {"model": "tiny-llama", "num_kv_heads": 2}),
            ("bad", {"model": "other"}),
        ):
            recv = KVTransferConfig(
                need_recv_cache=True,
                stage_id=1,
                from_stage=0,
                recv_timeout=5,
                connector_config={"namespace": ns},
                expect_kv=expect,
            )
            with KVTransferManager(recv) as receiver:
                if rid == "good":
                    data, _ = receiver.receive_kv_cache_for_request(rid)
                    assert data.metadata["kv_spec"]["fingerprint"] == sender.kv_spec["fingerprint"]
                    del data
                else:
                    with pytest.raises(
                        TransferCorrupt, match="model: sender 'tiny-llama', stage 1 expects 'other'"
                    ):
                        receiver.receive_kv_cache_for_request(rid)
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []


def test_a_send_whose_gather_fails_reads_failed_with_the_reason() -> None:
    ns = shm_namespace("badgather")
    settings = RunnerSettings.from_dict(
        {
            "stage_id": 0,
            "kv_transfer": {"need_send_cache": True, "to_stage": 1, "connector_config": {"namespace": ns}},
        }
    )
    sender = WorkerKVSender(settings, fake_cpu_caches(2, 3), None, num_kv_heads=2, block_size=BLOCK)
    try:
        sender.send([KVSendSpec("eng-1", "user-1", ((0,),), 5 * BLOCK, release=True)])  # 1 block, 5 needed
        status = sender.status(["user-1"])["user-1"]["kv"]
        assert status.startswith("failed: gather failed") and "blocks hold at most" in status, status
    finally:
        sender.shutdown()
    assert shm_entries(ns) == []


def test_runtime_that_is_never_shut_down_releases_everything_at_process_exit() -> None:
    ns = shm_namespace("exit")
    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    child = ctx.Process(target=exit_without_shutdown_child, args=(ns, report))
    child.start()
    pid, names = report.get(timeout=60)
    child.join(60)
    assert child.exitcode == 0
    # While alive it held a pool segment and the published (unclaimed) payload ...
    assert any(f".p.{pid}." in n for n in names) and any(".k." in n for n in names), names
    # ... and its exit path (no kvbridge_shutdown call) released them, nobody reaped.
    assert shm_entries(ns) == []


def test_leftovers_of_a_killed_process_are_reaped_and_live_ones_kept() -> None:
    ns = shm_namespace("kill")
    # A live sender on the same edge (first: a put reaps dead owners' names itself).
    live = create_connector("SharedMemoryConnector", {"namespace": ns})
    try:
        assert live.put(0, 1, "alive", {"x": torch.zeros(2)}).ok
        mine = shm_entries(ns)
        ctx = mp.get_context("spawn")
        report = ctx.Queue()
        child = ctx.Process(target=killed_sender_child, args=(ns, report))
        child.start()
        pid, names = report.get(timeout=60)
        child.join(60)
        assert child.exitcode == -9
        names = [n for n in names if n not in mine]
        assert any(f".p.{pid}." in n for n in names) and any(".k." in n for n in names), names
        assert sorted(shm_entries(ns)) == sorted(mine + names)  # SIGKILL: nothing ran
        removed = reap_stage_leftovers(payload_producer_settings(ns))
        assert sorted(removed) == sorted(names)
        assert shm_entries(ns) == mine
    finally:
        live.close()
    assert shm_entries(ns) == []
    # Edges of connectors without named OS resources are skipped, not an error.
    zmq_edge = {"stage_id": 0, "payload": {"outputs": [{"to_stage": 1, "connector": "zmq"}]}}
    assert reap_stage_leftovers(zmq_edge) == []
