"""A worker's KV sender on a real shared-memory edge, outside an engine (backpressure and
staging tests): the sender, its specs, a receiver and an exact check of what arrived."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import torch
from kv_fixtures import BLOCK, fake_cpu_caches, reference_kv, request_plan

from vllm_kvbridge.connectors.registry import register_connector
from vllm_kvbridge.connectors.shm import SharedMemoryConnector
from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.manager import KVTransferManager
from vllm_kvbridge.runner.kv_sender import WorkerKVSender
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.vllm_connector import KVSendSpec

PLAN = request_plan(5)  # every request sends this many tokens: equal segment sizes


class GatedShm(SharedMemoryConnector):
    """A real shm connector whose publishes wait for ``gate`` (a link slower than the engine)."""

    name = "KVSenderGatedShm"  # unique: the registry is per process, shared by every module
    gate = threading.Event()

    def _publish_lent(self, reservation: Any, start: float) -> Any:  # puts and KV publishes
        assert type(self).gate.wait(30), "the test never opened the gate"
        return super()._publish_lent(reservation, start)


register_connector(GatedShm.name, GatedShm, replace=True)


class DeviceResidentShm(SharedMemoryConnector):
    """A real shm connector that says its reservations are device memory, as CUDA IPC's
    are (``device_resident``): the KV sender gathers straight into what it lends, never
    through the staging pool. On CPU caches the "device" is the host, so this runs here the
    sender's logic for such a connector, its full answers included (``max_held_bytes``)."""

    name = "KVSenderDeviceResidentShm"
    device_resident = True


register_connector(DeviceResidentShm.name, DeviceResidentShm, replace=True)


def wait(pred: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not met"
        time.sleep(0.01)


def worker(ns: str, *, max_held_bytes: int = 1 << 40, **kv: Any) -> WorkerKVSender:
    """The KV sender of a stage 0 (2 KV heads, fake CPU caches) on the shm edge of ``ns``."""
    settings = RunnerSettings.from_dict(
        {
            "stage_id": 0,
            "kv_transfer": {
                "need_send_cache": True,
                "to_stage": 1,
                "connector": kv.pop("connector", "SharedMemoryConnector"),
                "connector_config": {"namespace": ns, "max_held_bytes": max_held_bytes},
                **kv,
            },
        }
    )
    return WorkerKVSender(settings, fake_cpu_caches(2, 3), None, num_kv_heads=2, block_size=BLOCK)


def spec(rid: str, *, release: bool = True) -> KVSendSpec:
    """A send of ``PLAN`` for transfer id ``rid`` (engine id ``e-<rid>``); ``release``: a
    finished request's, whose blocks the scheduler holds for the sender."""
    return KVSendSpec(f"e-{rid}", rid, (tuple(PLAN["block_ids"]),), PLAN["seq_len"], release=release)


def receiver(ns: str) -> KVTransferManager:
    cfg = KVTransferConfig(
        need_recv_cache=True, stage_id=1, from_stage=0, recv_timeout=5, connector_config={"namespace": ns}
    )
    return KVTransferManager(cfg, num_kv_heads=2)


def read_exact(recv: KVTransferManager, rid: str) -> None:
    """Receive ``rid`` and check it bit-exact; its segment goes back once the data is freed."""
    data, _ = recv.receive_kv_cache_for_request(rid)
    keys, values = reference_kv(fake_cpu_caches(2, 3), PLAN)
    assert all(torch.equal(a, b) for a, b in zip(data.key_cache, keys, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(data.value_cache, values, strict=True))
    del data
    gc.collect()


def status(sender: WorkerKVSender, rid: str) -> str:
    return sender.status([rid])[rid]["kv"]


def held_until_it_fails(sender: WorkerKVSender, ns: str, first: str, held: str) -> str:
    """Engine steps while ``held`` is held (``first``'s put waits at :class:`GatedShm`'s
    gate) until it fails for ``send_timeout``: its blocks go back ungathered. Then the gate
    opens and ``first`` must arrive exact. Returns ``held``'s status line."""
    wait(lambda: (sender.send([]), sender.held() == 0)[1], timeout=5)
    assert sender.take_released() == {f"e-{held}"}
    why = status(sender, held)
    GatedShm.gate.set()
    wait(lambda: status(sender, first) == "done")
    with receiver(ns) as recv:
        read_exact(recv, first)
    return why


def one_segment(ns: str) -> int:
    """Segment bytes one request's KV (``PLAN``) takes on a shm edge, measured by a real
    put (a sender whose ``max_held_bytes`` is a multiple of it holds that many)."""
    sender = worker(ns)
    try:
        sender.send([spec("probe")])
        wait(lambda: status(sender, "probe") == "done")
        held = sender.manager.connector.health()["held_bytes"]
        sender.discard(["probe"])
    finally:
        sender.shutdown()
    assert held > 0
    return held
