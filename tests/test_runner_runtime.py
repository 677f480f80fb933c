"""Runtime layer without vLLM: deferred cleanup of in-flight KV sends, release at process
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
from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.manager import KVTransferManager
from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin
from vllm_kvbridge.runner.runtime import reap_stage_leftovers

pytestmark = pytest.mark.forked


class _GatedShm(SharedMemoryConnector):
    """A real shared-memory connector whose puts wait until ``gate`` is set (a slow network)."""

    name = "GatedShm"
    gate = threading.Event()

    def put(self, from_stage, to_stage, key, payload):
        if not type(self).gate.wait(30):
            raise TimeoutError("gate never opened")
        return super().put(from_stage, to_stage, key, payload)


register_connector("GatedShm", _GatedShm, replace=True)


class _KVHost(KVBridgeModelRunnerMixin):
    """A runner that owns a paged KV cache (the host hooks of a KV sender)."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches

    def kvbridge_kv_caches(self) -> list[torch.Tensor]:
        return self.caches

    def kvbridge_block_size(self) -> int:
        return BLOCK


def _wait(pred, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.01)


def _kvbridge_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("kvbridge-"))


@pytest.mark.parametrize("aborted", [False, True])
def test_request_ended_while_its_kv_send_is_in_flight_is_kept_until_the_send_completes(aborted: bool) -> None:
    ns = shm_namespace("gate")
    caches, plan = fake_cpu_caches(2, 3), request_plan(5)
    host = _KVHost(caches)
    host.kvbridge_init(
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
    _GatedShm.gate.clear()
    try:
        host.kvbridge_register_request("eng-1", "user-1")
        assert host.kvbridge_send_kv([("eng-1", plan["block_ids"], plan["seq_len"])]) == ["eng-1"]
        host.kvbridge_mark_finished("eng-1", aborted=aborted)
        time.sleep(0.2)  # the I/O thread is now blocked in the put
        # Ended, but the send is in flight: the state stays (deferred cleanup).
        state = host.kvbridge_debug_state()
        assert state["requests"] == ["eng-1"] and state["kv_pending"] == 1, state
        kept = host.kvbridge_request_state("eng-1")
        assert kept.finished and kept.aborted == aborted and kept.kv == "pending"
        assert host.kvbridge_transfer_status(["user-1"])["user-1"]["kv"] == "pending"
        _GatedShm.gate.set()
        # Once the send completed, the next reap releases everything of the request.
        _wait(lambda: host.kvbridge_debug_state()["requests"] == [])
        assert host.kvbridge_request_state("eng-1") is None
        assert host.kvbridge_debug_state()["kv_pending"] == 0
        assert host.kvbridge_transfer_status(["user-1"])["user-1"] == {
            "kv": "done",
            "payload": "none",
            "aborted": str(aborted).lower(),
        }
        assert host._kvb_engine_to_transfer == {}
        # The KV that left is whole (the gather happened before the request ended).
        info = host.kvbridge_sender_info(["eng-1"])["kv"]["eng-1"]
        recv = KVTransferConfig(
            need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=5, connector_config={"namespace": ns}
        )
        with KVTransferManager(recv) as receiver:
            data, _ = receiver.receive_kv_cache_for_request("user-1", sender_info=info)
            keys, values = reference_kv(caches, plan)
            assert all(torch.equal(a, b) for a, b in zip(data.key_cache, keys))
            assert all(torch.equal(a, b) for a, b in zip(data.value_cache, values))
            del data
    finally:
        _GatedShm.gate.set()
        host.kvbridge_shutdown()
    assert _kvbridge_threads() == []
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
