"""Giving up a receive whose producer was lost: which connectors' unread data dies with the
sender, the read/withdrawn decision of the KV manager (real ZMQ sender in another process),
the payload receiver's counterpart, the ``ProducerLost`` notices the orchestrator sends.
End to end with real engines: ``test_pipeline_producer_lost.py``."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kv_fixtures import sender_main

from vllm_kvbridge.config.resolve import resolve
from vllm_kvbridge.connectors.base import Connector
from vllm_kvbridge.connectors.registry import _BUILTINS
from vllm_kvbridge.connectors.shm import SharedMemoryConnector
from vllm_kvbridge.errors import ReceiveWithdrawn, TransferError
from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.manager import KVTransferManager
from vllm_kvbridge.kv.receive import ReadLedger
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.results import RequestResult, StageRecord
from vllm_kvbridge.pipeline.supervision import RestartPolicy, StageSupervision, producer_lost_notices
from vllm_kvbridge.runner.payload_receiver import PayloadReceiver

ROOT = Path(__file__).resolve().parent.parent
OUTLIVES = {
    "SharedMemoryConnector": True,
    "MooncakeStoreConnector": True,
    "ZmqConnector": False,
    "MooncakeTransferEngineConnector": False,
    "NixlConnector": False,
    "CudaIpcConnector": False,  # the device buffer dies with the sender's CUDA context
    "RoutedConnector": False,  # an instance: True when every one of its routes' is
}


def test_every_builtin_connector_declares_whether_unread_data_outlives_its_sender() -> None:
    assert Connector.data_outlives_sender is True  # unknown: keep waiting, never fail wrongly
    assert set(OUTLIVES) == set(_BUILTINS)
    for name, ref in _BUILTINS.items():
        module, _, attr = ref.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        assert "data_outlives_sender" in vars(cls), f"{name} does not declare data_outlives_sender"
        assert cls.data_outlives_sender is OUTLIVES[name], name


def test_the_ledger_never_calls_one_request_both_read_and_withdrawn() -> None:
    ledger = ReadLedger(max_items=2)
    ledger.commit("read")
    assert ledger.withdraw("read") is False and not ledger.is_withdrawn("read")
    assert ledger.withdraw("unread") is True and ledger.is_withdrawn("unread")
    with pytest.raises(ReceiveWithdrawn):
        ledger.commit("unread")  # arrived after it was given up: dropped
    ledger.forget("unread")
    ledger.commit("unread")  # the id came again (a new request)
    assert ledger.withdraw("unread") is False


def _cfg(recv_timeout: float, **kw: Any) -> KVTransferConfig:
    return KVTransferConfig(
        need_recv_cache=True,
        stage_id=1,
        from_stage=0,
        connector="ZmqConnector",
        connector_config={"host": "127.0.0.1", "port": 0},
        recv_timeout=recv_timeout,
        **kw,
    )


@pytest.mark.forked
def test_read_kv_is_kept_and_unread_kv_of_a_dead_sender_is_given_up_at_once() -> None:
    ctx = mp.get_context("spawn")
    info_q, stop = ctx.Queue(), ctx.Event()
    rids = ["read", "prefetched", "unread"]
    proc = ctx.Process(
        target=sender_main, args=("ZmqConnector", {"host": "127.0.0.1", "port": 0}, rids, 3, info_q, stop)
    )
    proc.start()
    try:
        report = info_q.get(timeout=60)
        assert report["done"] == sorted(rids)
        info = report["info"]
        with KVTransferManager(_cfg(120, enable_kv_async_prefetch=True), num_kv_heads=2) as mgr:
            assert mgr.receive_multi_kv_cache("read", sender_info=info["read"])
            assert mgr.withdraw_receive("read") is False  # read: kept
            assert mgr.pop_received("read") is not None
            assert mgr.start_prefetch([("prefetched", info["prefetched"])]) == ["prefetched"]
            deadline = time.monotonic() + 30
            while mgr.prefetcher.in_flight() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert mgr.withdraw_receive("prefetched") is False  # a finished prefetch is a read
            assert mgr.consume_and_distribute_kv_cache("prefetched", sender_info=info["prefetched"])
            assert mgr.pop_received("prefetched") is not None

            stop.set()  # the sender exits: "unread" dies with it
            proc.join(30)
            errors: list[BaseException] = []

            def receive() -> None:
                try:
                    mgr.receive_multi_kv_cache("unread", sender_info=info["unread"])
                except BaseException as exc:
                    errors.append(exc)

            t = threading.Thread(target=receive)
            t.start()
            t0 = time.monotonic()
            assert mgr.withdraw_receive("unread") is True
            t.join(10)
            assert not t.is_alive() and time.monotonic() - t0 < 10  # recv_timeout is 120 s
            assert len(errors) == 1 and isinstance(errors[0], ReceiveWithdrawn), errors
            mgr.forget_receive("unread")
    finally:
        stop.set()
        proc.join(30)


def test_payload_receiver_withdraws_only_what_is_still_receiving(tmp_path: Path) -> None:
    conn = SharedMemoryConnector({"namespace": f"kvbwd{time.monotonic_ns()}"})
    rx = PayloadReceiver(conn, 0, 1, mode="full", recv_timeout_s=120, close_connector=True)
    try:
        rx.expect("r")
        assert rx.withdraw("r") is True
        with pytest.raises(TransferError):
            rx.result("r", timeout=1)
        assert rx.withdraw("r") is False and rx.withdraw("never") is False
    finally:
        rx.close()


def test_producer_lost_round_trips_and_request_failed_names_the_lost_stage() -> None:
    msg = m.ProducerLost(0, "llm_ar", ["a", "b"])
    assert m.decode_to_stage(m.encode(msg)) == msg
    failed = m.RequestFailed("a", 1, "lost", lost_stage=0)
    assert m.decode_from_stage(m.encode(failed)) == failed
    assert m.decode_from_stage(m.encode(m.RequestFailed("a", 1, "x"))).lost_stage is None


def test_notices_name_what_the_lost_stage_handed_on_and_wait_for_a_recovering_consumer() -> None:
    producer = resolve(ROOT / "stage_configs/ar_to_dit_zmq.yaml").stages[0]

    def result(rid: str, done0: bool, finished: bool = False) -> RequestResult:
        r = RequestResult(rid, "p", [StageRecord(0, "llm_ar", 0.0, done=1.0 if done0 else 0.0)])
        r.finished = finished
        return r

    results = {
        "handed": result("handed", True),
        "in_producer": result("in_producer", False),
        "finished": result("finished", True, finished=True),
        "waiting": result("waiting", True),
    }
    where = {"handed": {1}, "in_producer": {0}, "finished": {1}}
    # keyed by (stage id, replica): one replica each here
    sups = {(0, 0): StageSupervision(RestartPolicy()), (1, 0): StageSupervision(RestartPolicy())}
    assert producer_lost_notices(producer, results, where, sups) == {
        (1, 0): m.ProducerLost(0, "llm_ar", ["handed"])
    }
    assert sups[1, 0].notices == []
    # stage 1 is recovering with "waiting" queued for it: told once it is back
    sups[1, 0].lost(m_error(), now=1.0)
    sups[1, 0].pending.append(m.Submit("waiting", upstream=[m.Upstream(0, "waiting")]))
    producer_lost_notices(producer, results, where, sups)
    assert sups[1, 0].notices == [m.ProducerLost(0, "llm_ar", ["waiting"])]


def m_error() -> Any:
    from vllm_kvbridge.pipeline.results import StageError

    return StageError(1, "diffusion", "process exited")
