"""KVTransferManager with real connectors: two processes, retries, failures, prefetch, config."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import threading
import time
from typing import Any

import pytest
import torch
from kv_fixtures import BLOCK, fake_cpu_caches, reference_kv, request_plan, sender_main

from vllm_kvbridge.connectors.registry import register_connector
from vllm_kvbridge.connectors.shm import SharedMemoryConnector
from vllm_kvbridge.errors import ConfigError, TransferCorrupt, TransferTimeout
from vllm_kvbridge.kv.config import KVTransferConfig
from vllm_kvbridge.kv.manager import KVPrefetchConsumeError, KVTransferManager
from vllm_kvbridge.kv.metrics import KVTransferMetrics
from vllm_kvbridge.wire.kv_format import KVCacheTransferData


def _shm_leftovers(ns: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if ns in n]


def _recv_cfg(connector: str, connector_config: dict[str, Any], **kw: Any) -> KVTransferConfig:
    return KVTransferConfig(
        need_recv_cache=True,
        stage_id=1,
        from_stage=0,
        connector=connector,
        connector_config=connector_config,
        **kw,
    )


def _assert_exact(data: KVCacheTransferData, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    assert len(data.key_cache) == len(keys)
    for got, want in zip(data.key_cache, keys):
        assert torch.equal(got, want)
    for got, want in zip(data.value_cache, values):
        assert torch.equal(got, want)


@pytest.mark.forked
@pytest.mark.parametrize(
    ("connector", "config"),
    [
        ("SharedMemoryConnector", {"namespace": "kvtestmgr"}),
        ("ZmqConnector", {"host": "127.0.0.1", "port": 0}),
    ],
)
def test_two_process_send_receive_bit_exact(connector: str, config: dict[str, Any]) -> None:
    ctx = mp.get_context("spawn")
    info_q, stop = ctx.Queue(), ctx.Event()
    rids = ["req-a", "req/b with spaces", "req-c"]
    proc = ctx.Process(target=sender_main, args=(connector, config, rids, 11, info_q, stop))
    proc.start()
    try:
        report = info_q.get(timeout=60)
        assert report["done"] == sorted(rids) and report["failed"] == []
        caches = fake_cpu_caches(2, 11)
        with KVTransferManager(_recv_cfg(connector, config, recv_timeout=10), num_kv_heads=2) as mgr:
            for i, rid in enumerate(rids):
                data, nbytes = mgr.receive_kv_cache_for_request(rid, sender_info=report["info"][rid])
                assert data.request_id == rid and data.seq_len == request_plan(i)["seq_len"]
                assert nbytes == data.nbytes > 0
                _assert_exact(data, *reference_kv(caches, request_plan(i)))
            # a request nobody sent: the wait ends with a timeout error, not "no KV"
            mgr2 = KVTransferManager(_recv_cfg(connector, config, recv_timeout=0.5), num_kv_heads=2)
            with mgr2, pytest.raises(TransferTimeout):
                mgr2.receive_kv_cache_for_request("never-sent", sender_info=report["info"][rids[0]])
            health = mgr.health()
            assert health["metrics"]["recv"]["transfers"] == 3 and health["metrics"]["recv"]["in_flight"] == 0
    finally:
        stop.set()
        proc.join(30)
        assert proc.exitcode == 0
    assert _shm_leftovers("kvtestmgr") == []


class _FlakyShm(SharedMemoryConnector):
    """A real shared-memory connector whose first ``fail_first`` publishes raise (the KV
    sender publishes the segment it gathered into; a put publishes the same way)."""

    name = "FlakyShm"

    def __init__(self, config: dict[str, Any]) -> None:
        config = dict(config)
        self.fail_first = config.pop("fail_first")
        self.put_calls = 0
        super().__init__(config)

    def _publish_lent(self, reservation, start):
        self.put_calls += 1
        if self.fail_first < 0 or self.put_calls <= self.fail_first:
            raise OSError(f"injected put failure #{self.put_calls}")
        return super()._publish_lent(reservation, start)


register_connector("FlakyShm", _FlakyShm, replace=True)


def _send_cfg(connector: str = "FlakyShm", **kw: Any) -> KVTransferConfig:
    base = {
        "need_send_cache": True,
        "stage_id": 0,
        "to_stage": 1,
        "connector": connector,
        "send_backoff_s": 0.01,
        "send_max_backoff_s": 0.05,
    }
    base.update(kw)
    return KVTransferConfig(**base)


def _wait_finished(mgr: KVTransferManager, n: int, timeout: float = 10) -> tuple[set[str], set[str]]:
    done: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done | failed) < n and time.monotonic() < deadline:
        d, f = mgr.get_finished()
        done |= d
        failed |= f
        time.sleep(0.005)
    return done, failed


@pytest.mark.forked
def test_flaky_connector_succeeds_on_retry() -> None:
    caches = fake_cpu_caches(2, 3)
    plan = request_plan(4)
    cfg = _send_cfg(send_retries=3, connector_config={"fail_first": 2, "namespace": "kvtestretry"})
    recv = _recv_cfg("SharedMemoryConnector", {"namespace": "kvtestretry"}, recv_timeout=5)
    with (
        KVTransferManager(cfg, num_kv_heads=2) as sender,
        KVTransferManager(recv, num_kv_heads=2) as receiver,
    ):
        assert sender.handle_finished_requests_kv_transfer({"r1": plan}, caches, BLOCK, "auto") == ["r1"]
        assert _wait_finished(sender, 1) == ({"r1"}, set())
        assert sender.connector.put_calls == 3
        assert sender.health()["metrics"]["send"]["retries"] == 2
        data, _ = receiver.receive_kv_cache_for_request("r1")
        _assert_exact(data, *reference_kv(caches, plan))
    assert _shm_leftovers("kvtestretry") == []


@pytest.mark.forked
def test_always_failing_connector_reports_failure_within_budget() -> None:
    caches = fake_cpu_caches(2, 3)
    cfg = _send_cfg(send_retries=3, connector_config={"fail_first": -1, "namespace": "kvtestfail"})
    budget = sum(cfg.backoff(i) for i in range(cfg.send_retries)) + 2.0
    recv = _recv_cfg("SharedMemoryConnector", {"namespace": "kvtestfail"}, recv_timeout=1.0)
    with (
        KVTransferManager(cfg, num_kv_heads=2) as sender,
        KVTransferManager(recv, num_kv_heads=2) as receiver,
    ):
        sender.handle_finished_requests_kv_transfer({"r1": request_plan(1)}, caches, BLOCK, "auto")
        start = time.monotonic()  # the budget counts from the submission
        done, failed = _wait_finished(sender, 1, timeout=budget)
        assert (done, failed) == (set(), {"r1"})
        assert time.monotonic() - start < budget
        assert sender.connector.put_calls == 4
        assert sender.get_sender_info("r1") is None
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            receiver.receive_kv_cache_for_request("r1")
        assert 0.9 < time.monotonic() - t0 < 3
        assert receiver.health()["metrics"]["recv"]["timeouts"] == 1


@pytest.mark.forked
def test_gather_errors_fail_only_that_request_and_connector_creation_is_retried() -> None:
    caches = fake_cpu_caches(2, 3)
    cfg = _send_cfg(connector_config={"fail_first": 0, "namespace": "kvtestgath"})
    with KVTransferManager(cfg, num_kv_heads=2) as sender:
        reqs = {
            "bad": {"block_ids": [0, 99], "seq_len": 40},
            "short": {"block_ids": [0], "seq_len": 40},
            "ok": request_plan(2),
        }
        assert sender.handle_finished_requests_kv_transfer(reqs, caches, BLOCK, "auto") == ["ok"]
        assert _wait_finished(sender, 3) == ({"ok"}, {"bad", "short"})
        sender.connector.cleanup(next(iter(sender.get_sender_info("ok")["keys"])))
    # a connector whose creation fails is retried on the next use, not cached as broken
    calls = []

    def factory(config: dict[str, Any]) -> SharedMemoryConnector:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("first creation fails")
        return SharedMemoryConnector({"namespace": "kvtestlazy"})

    register_connector("FlakyCreate", factory, replace=True)
    with KVTransferManager(_send_cfg("FlakyCreate", send_retries=2), num_kv_heads=2) as sender:
        sender.handle_finished_requests_kv_transfer({"r": request_plan(3)}, caches, BLOCK, "auto")
        assert _wait_finished(sender, 1) == ({"r"}, set())
        assert len(calls) == 2
    assert _shm_leftovers("kvtestlazy") == []


@pytest.mark.forked
def test_prefetch_twenty_requests_random_order_two_failing() -> None:
    caches = fake_cpu_caches(2, 5)
    ns = {"namespace": "kvtestpf"}
    send = _send_cfg("SharedMemoryConnector", connector_config=ns)
    recv = _recv_cfg(
        "SharedMemoryConnector",
        ns,
        recv_timeout=1.5,
        enable_kv_async_prefetch=True,
        max_prefetch_inflight=4,
        kv_prefetch_min_free_mem_ratio=0.0,
    )
    rids = [f"p{i}" for i in range(20)]
    never_sent, corrupt = "p7", "p13"
    rng = random.Random(0)
    with (
        KVTransferManager(send, num_kv_heads=2) as sender,
        KVTransferManager(recv, num_kv_heads=2) as receiver,
    ):
        sender._layout_for(caches, BLOCK, "auto")  # warm vLLM's import (~10 s here) before the clock runs
        assert receiver.start_prefetch(rids) == rids
        order = [r for r in rids if r != never_sent]
        rng.shuffle(order)

        def produce() -> None:
            for rid in order:
                i = rids.index(rid)
                if rid == corrupt:  # a payload of another request under this request's key
                    data = KVCacheTransferData(
                        "someone-else", {"key_cache": [torch.zeros(1)], "value_cache": [torch.zeros(1)]}
                    )
                    key = receiver.topology().routes[0].key(rid, 0, 1)
                    assert sender.connector.put(0, 1, key, data).ok
                    continue
                sender.handle_finished_requests_kv_transfer({rid: request_plan(i)}, caches, BLOCK, "auto")
                time.sleep(rng.random() * 0.01)

        producer = threading.Thread(target=produce)
        producer.start()
        results: dict[str, Any] = {}
        consume_order = list(rids)
        rng.shuffle(consume_order)
        for rid in consume_order:
            try:
                assert receiver.consume_and_distribute_kv_cache(rid)
                results[rid] = receiver.pop_received(rid)
            except (TransferTimeout, KVPrefetchConsumeError) as exc:
                results[rid] = exc
        producer.join()
        ok = [r for r in rids if not isinstance(results[r], Exception)]
        assert len(ok) == 18, {r: results[r] for r in rids if r not in ok}
        for rid in ok:
            _assert_exact(results[rid].data, *reference_kv(caches, request_plan(rids.index(rid))))
        assert isinstance(results[never_sent], TransferTimeout)
        assert isinstance(results[corrupt], KVPrefetchConsumeError)
        assert "someone-else" in str(results[corrupt])
        # start one more prefetch that cannot complete, then shut down: nothing left in flight
        receiver.start_prefetch(["late"])
    assert receiver.prefetcher.in_flight() == 0
    assert receiver.health()["metrics"]["recv"]["in_flight"] == 0
    assert sender.pending_sends() == 0
    assert not [
        t for t in threading.enumerate() if t.name.startswith(("kvbridge-prefetch", "kvbridge-kv-send"))
    ]
    assert _shm_leftovers("kvtestpf") == []


@pytest.mark.forked
def test_cfg_companions_through_one_hook() -> None:
    caches = fake_cpu_caches(2, 8)
    ns = {"namespace": "kvtestcfg"}
    with (
        KVTransferManager(_send_cfg("SharedMemoryConnector", connector_config=ns), num_kv_heads=2) as sender,
        KVTransferManager(_recv_cfg("SharedMemoryConnector", ns, recv_timeout=3), num_kv_heads=2) as receiver,
    ):
        # engine ids -> one user request id; the companion carries its purpose
        finished = {"eng-1": request_plan(1), "eng-1-neg": {**request_plan(2), "purpose": "cfg_neg"}}
        sender.handle_finished_requests_kv_transfer(
            finished, caches, BLOCK, "auto", request_id_resolver=lambda e: "user-1"
        )
        assert _wait_finished(sender, 2) == ({"eng-1", "eng-1-neg"}, set())

        class Req:
            request_id = "user-1"

        req = Req()
        assert receiver.receive_multi_kv_cache(req, lambda r: ["cfg_neg"])
        _assert_exact(req.kv_transfer_data, *reference_kv(caches, request_plan(1)))
        _assert_exact(req.cfg_kv_transfer_data["cfg_neg"], *reference_kv(caches, request_plan(2)))
        assert req.cfg_kv_transfer_data["cfg_neg"].metadata["purpose"] == "cfg_neg"
        with pytest.raises(ConfigError):
            receiver.receive_multi_kv_cache(req, lambda r: ["kv"])
    assert _shm_leftovers("kvtestcfg") == []


@pytest.mark.forked
def test_corrupt_sync_receive_and_shutdown_semantics() -> None:
    ns = {"namespace": "kvtestcorr"}
    with (
        KVTransferManager(_recv_cfg("SharedMemoryConnector", ns, recv_timeout=2), num_kv_heads=2) as receiver,
        SharedMemoryConnector(ns) as raw,
    ):
        key = receiver.topology().routes[0].key("r9", 0, 1)
        assert raw.put(0, 1, key, {"not": "kv"}).ok
        with pytest.raises(TransferCorrupt, match="expected KVCacheTransferData"):
            receiver.receive_kv_cache_for_request("r9")
        # a receive blocked on the deadline is interrupted by shutdown
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                receiver.receive_kv_cache_for_request("r10")
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        receiver.shutdown()
        t.join(5)
        assert not t.is_alive() and time.monotonic() - t0 < 1.5 and errors
    # not configured to receive: (None, 0), not an error
    with KVTransferManager(KVTransferConfig()) as idle:
        assert idle.receive_kv_cache_for_request("x") == (None, 0)
        assert idle.handle_finished_requests_kv_transfer({"x": request_plan(0)}, [], BLOCK, "auto") == []
    assert _shm_leftovers("kvtestcorr") == []


def test_config_from_dict_and_stages() -> None:
    cfg = KVTransferConfig.from_dict({"need_send_cache": True, "to_stage": 2, "from_tp": 2, "to_tp": 4})
    assert cfg.send_stages == [2] and cfg.recv_stages == []
    assert KVTransferConfig.from_dict({"need_recv_cache": True, "engine_input_source": [0]}).recv_stages == [
        0
    ]
    with pytest.raises(ConfigError, match=r"kv_transfer\.bogus: unknown key"):
        KVTransferConfig.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match="from_tp"):
        KVTransferConfig.from_dict({"from_tp": "two"})
    with pytest.raises(ConfigError, match="recv_timeout"):
        KVTransferConfig.from_dict({"recv_timeout": 0})
    with pytest.raises(ConfigError, match="to_stage"):
        KVTransferConfig.from_dict({"need_send_cache": True})
    with pytest.raises(ConfigError, match="from_stage"):
        KVTransferConfig.from_dict({"need_recv_cache": True})
    with pytest.raises(ConfigError, match="expected a mapping"):
        KVTransferConfig.from_dict([1])  # type: ignore[arg-type]
    assert [cfg.backoff(i) for i in range(3)] == [0.05, 0.1, 0.2]
    with pytest.raises(ConfigError, match="to_tp must be 1"):
        KVTransferManager(
            KVTransferConfig(need_recv_cache=True, from_stage=0, to_tp=2, distribution="leader")
        )


def test_from_vllm_config_and_stage_config() -> None:
    class ModelConfig:
        def get_total_num_kv_heads(self) -> int:
            return 8

    class VllmConfig:
        additional_config = {
            "kvbridge": {"kv_transfer": {"need_recv_cache": True, "from_stage": 0, "stage_id": 1, "to_tp": 2}}
        }
        model_config = ModelConfig()

    mgr = KVTransferManager.from_vllm_config(VllmConfig())
    assert (mgr.num_kv_heads, mgr.tp_rank, mgr.recv_stages) == (8, 0, [0])
    assert [r.from_rank for r in mgr.topology().routes_to(1)] == [0]
    mgr.shutdown()
    VllmConfig.additional_config = {"kvbridge": {}}
    with pytest.raises(ConfigError, match="missing"):
        KVTransferManager.from_vllm_config(VllmConfig())
    VllmConfig.additional_config = {"kvbridge": {"kv_transfer": {"oops": 1}}}
    with pytest.raises(ConfigError, match=r"kvbridge\.kv_transfer\.oops"):
        KVTransferManager.from_vllm_config(VllmConfig())
    # The settings a stock `vllm serve --kv-transfer-config` carries, in the connector's extra config.
    VllmConfig.additional_config = None
    VllmConfig.kv_transfer_config = type("KVT", (), {"kv_connector_extra_config": {"kvbridge": {}}})()
    VllmConfig.kv_transfer_config.kv_connector_extra_config["kvbridge"] = {
        "kv_transfer": {"need_recv_cache": True, "from_stage": 0, "stage_id": 1}
    }
    mgr = KVTransferManager.from_vllm_config(VllmConfig())
    assert (mgr.num_kv_heads, mgr.recv_stages) == (8, [0])
    mgr.shutdown()
    VllmConfig.additional_config = {"kvbridge": {"kv_transfer": {"need_recv_cache": False}}}
    with pytest.raises(ConfigError, match="given twice and differ"):
        KVTransferManager.from_vllm_config(VllmConfig())
    mgr = KVTransferManager.from_stage_config(
        {"stage_id": 3, "kv_transfer": {"need_send_cache": True, "to_stage": 4}}
    )
    assert (mgr.config.stage_id, mgr.send_stages) == (3, [4])
    mgr.shutdown()
    with pytest.raises(ConfigError, match="no kv_transfer"):
        KVTransferManager.from_stage_config({"stage_id": 3})


def test_metrics_two_managers_and_health() -> None:
    a = KVTransferMetrics("s0", "shm")
    b = KVTransferMetrics("s0", "shm")  # same labels, no duplicate-timeseries error
    a.success("send", 100, 0.5)
    a.retry("send")
    b.timeout("recv")
    h = a.health()
    assert h["send"]["transfers"] == 1 and h["send"]["bytes"] == 100 and h["send"]["retries"] == 1
    assert h["send"]["last"] == {"bytes": 100, "seconds": 0.5}
    assert b.health()["recv"]["timeouts"] == 1
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(
        "kvbridge_kv_transfer_bytes_total", {"stage": "s0", "direction": "send", "connector": "shm"}
    )
    assert value is not None and value >= 100


@pytest.mark.forked
def test_receiver_takes_the_head_count_from_the_sender_unless_configured() -> None:
    caches = fake_cpu_caches(2, 5)  # a 2-KV-head model
    plan = request_plan(4)
    ns = {"namespace": "kvtestheads"}
    # TP 1 -> 2 sender: rank 0 slices head 0 for receiver rank 0 and head 1 for receiver rank 1.
    send = _send_cfg("SharedMemoryConnector", connector_config=ns, to_tp=2)
    with KVTransferManager(send) as sender:  # heads from the cache itself
        ids = ["h-plain", "h-rank1", "h-wrong", "h-info"]
        sender.handle_finished_requests_kv_transfer({r: plan for r in ids}, caches, BLOCK, "auto")
        assert _wait_finished(sender, len(ids)) == (set(ids), set())
        info = sender.get_sender_info("h-info")
        assert info["num_kv_heads"] == 2

        def receiver(rank: int, heads: int | None, **kw: Any) -> KVTransferManager:
            cfg = _recv_cfg("SharedMemoryConnector", ns, recv_timeout=3, to_tp=2, tp_rank=rank, **kw)
            return KVTransferManager(cfg, num_kv_heads=heads)

        # Not configured: learnt from the header of what arrived; each rank gets its head.
        for rank, rid in ((0, "h-plain"), (1, "h-rank1")):
            with receiver(rank, None) as mgr:
                data, _ = mgr.receive_kv_cache_for_request(rid)
                assert (data.head_start, data.head_end, data.num_kv_heads_total) == (rank, rank + 1, 2)
                _assert_exact(data, *reference_kv(caches, plan, rank, rank + 1))
        # Configured but wrong: a clear error, not a silently mis-sliced cache.
        with receiver(0, 4) as mgr, pytest.raises(TransferCorrupt, match=r"2 KV heads in all.*expects 4"):
            mgr.receive_kv_cache_for_request("h-wrong")
        # The sender's info carries the count too (what TP on both sides needs).
        with receiver(1, None) as mgr:
            data, _ = mgr.receive_kv_cache_for_request("h-info", sender_info=info)
            _assert_exact(data, *reference_kv(caches, plan, 1, 2))
    # TP on both sides, nothing configured and no sender info: refused before waiting.
    both = _recv_cfg("SharedMemoryConnector", ns, recv_timeout=3, from_tp=2, to_tp=2)
    with KVTransferManager(both) as mgr, pytest.raises(ConfigError, match="needs num_kv_heads"):
        mgr.receive_kv_cache_for_request("anything")
    assert _shm_leftovers("kvtestheads") == []


@pytest.mark.forked
def test_sender_info_does_not_grow_with_the_number_of_requests() -> None:
    caches = fake_cpu_caches(2, 6)
    ns = {"namespace": "kvtestinfo"}
    cfg = _send_cfg("SharedMemoryConnector", connector_config=ns)
    with KVTransferManager(cfg, num_kv_heads=2, max_sender_info=8) as sender:
        for batch in range(6):  # 60 requests, each filed under its engine id and transfer id
            ids = [f"eng-{batch}-{i}" for i in range(10)]
            sender.handle_finished_requests_kv_transfer(
                {r: request_plan(i) for i, r in enumerate(ids)},
                caches,
                BLOCK,
                "auto",
                request_id_resolver=lambda e: "user" + e[3:],
            )
            assert _wait_finished(sender, len(ids))[0] == set(ids)
            assert sender.health()["sender_info_entries"] <= 8
        # The newest requests are still answered, under either id, with the same info.
        assert sender.get_sender_info("eng-5-9") is sender.get_sender_info("user-5-9") is not None
        assert sender.get_sender_info("eng-0-0") is None
        # Forgetting drops both ids.
        assert sender.forget_sender_info("user-5-9") and sender.get_sender_info("eng-5-9") is None
        assert not sender.forget_sender_info("user-5-9")
    with KVTransferManager(cfg, num_kv_heads=2, sender_info_ttl_s=0.2) as sender:
        sender.handle_finished_requests_kv_transfer({"ttl": request_plan(1)}, caches, BLOCK, "auto")
        assert _wait_finished(sender, 1)[0] == {"ttl"}
        assert sender.get_sender_info("ttl") is not None
        time.sleep(0.3)
        assert sender.get_sender_info("ttl") is None and sender.health()["sender_info_entries"] == 0
    with pytest.raises(ConfigError):
        KVTransferManager(cfg, max_sender_info=0)


class _HeldPutShm(SharedMemoryConnector):
    """A real shared-memory connector whose publishes (of puts and of the KV sender's
    reservations alike) wait while ``gate`` is clear (its registry name is this module's
    own: test_runner_runtime registers a "GatedShm")."""

    name = "HeldPutShm"
    gate = threading.Event()
    entered = threading.Event()

    def _publish_lent(self, reservation, start):
        _HeldPutShm.entered.set()
        assert _HeldPutShm.gate.wait(10), "the test never opened the gate"
        return super()._publish_lent(reservation, start)


register_connector("HeldPutShm", _HeldPutShm, replace=True)


@pytest.mark.forked
def test_discarded_kv_is_withdrawn_now_and_when_a_send_in_flight_completes() -> None:
    """A request failed elsewhere: its KV is withdrawn whether it was sent already, is being
    sent, or is sent later; nothing stays for the TTL. Other requests keep theirs."""
    caches = fake_cpu_caches(2, 6)
    ns = {"namespace": "kvtestdiscard"}

    def published() -> list[str]:  # KV segments (not the connector's own buffer pool)
        return _shm_leftovers("kvtestdiscard.k.")

    cfg = _send_cfg("HeldPutShm", connector_config=ns)
    with KVTransferManager(cfg, num_kv_heads=2) as sender:
        _HeldPutShm.gate.set()
        sender.handle_finished_requests_kv_transfer({"sent": request_plan(1)}, caches, BLOCK, "auto")
        assert _wait_finished(sender, 1) == ({"sent"}, set()) and published()
        assert sender.discard_sent("sent") == 1 and published() == []

        _HeldPutShm.gate.clear()
        _HeldPutShm.entered.clear()
        plans = {"flying": request_plan(2), "kept": request_plan(3)}
        sender.handle_finished_requests_kv_transfer(plans, caches, BLOCK, "auto")
        assert _HeldPutShm.entered.wait(10)  # "flying" is being put
        assert sender.discard_sent("flying") == 0  # nothing out yet: withdrawn once it is
        assert sender.discard_sent("later") == 0  # not even submitted yet
        _HeldPutShm.gate.set()
        sender.handle_finished_requests_kv_transfer({"later": request_plan(4)}, caches, BLOCK, "auto")
        assert _wait_finished(sender, 3) == ({"flying", "kept", "later"}, set())
        assert sender.get_sender_info("flying") is None and sender.get_sender_info("later") is None
        [kept] = sender.get_sender_info("kept")["keys"]
        left = published()
        assert len(left) == 1 and left[0].endswith(kept), left
        assert sender.discard_sent("kept") == 1
    assert _shm_leftovers("kvtestdiscard") == []


@pytest.mark.forked
def test_consumed_pieces_wait_for_their_siblings_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2 -> 1 where rank 1's piece is late: the piece of rank 0 that a timed-out attempt
    consumed is kept for the next attempt (which completes once rank 1's arrives); one
    nobody asks for again is dropped after its keep time, and a late attempt then fails at
    once naming it (it never waits for data it consumed); the table stays bounded."""
    from vllm_kvbridge.kv import receive

    monkeypatch.setattr(receive, "PART_KEEP_S", 0.5)
    monkeypatch.setattr(receive, "MAX_PARTS", 8)
    caches = fake_cpu_caches(2, 6)
    ns = {"namespace": "kvtestparts"}

    def sender(rank: int) -> KVTransferManager:
        cfg = _send_cfg("SharedMemoryConnector", connector_config=ns, from_tp=2, tp_rank=rank)
        return KVTransferManager(cfg, num_kv_heads=4)

    def send(mgr: KVTransferManager, ids: list[str]) -> None:
        mgr.handle_finished_requests_kv_transfer({r: request_plan(1) for r in ids}, caches, BLOCK, "auto")
        assert _wait_finished(mgr, len(ids)) == (set(ids), set())

    recv = _recv_cfg("SharedMemoryConnector", ns, recv_timeout=0.2, from_tp=2)
    many = [f"many-{i}" for i in range(20)]
    with sender(0) as rank0, sender(1) as rank1, KVTransferManager(recv) as receiver:
        send(rank0, ["retry", "gone", *many])
        with pytest.raises(TransferTimeout):
            receiver.receive_kv_cache_for_request("retry")
        assert receiver.health()["parts_waiting"] == 1  # rank 0's piece, consumed
        send(rank1, ["retry"])
        data, _ = receiver.receive_kv_cache_for_request("retry")
        assert (data.head_start, data.head_end, data.num_kv_heads_total) == (0, 4, 4)
        assert receiver.health()["parts_waiting"] == 0

        with pytest.raises(TransferTimeout):
            receiver.receive_kv_cache_for_request("gone")
        time.sleep(0.6)  # past the keep time: dropped (and remembered)
        assert receiver.health()["parts_waiting"] == 0
        send(rank1, ["gone"])
        t0 = time.monotonic()
        with pytest.raises(TransferCorrupt, match=r"kvb\.0-1\.kv\.igone\..*consumed by an earlier attempt"):
            receiver.receive_kv_cache_for_request("gone")
        assert time.monotonic() - t0 < 0.2  # at once, not after recv_timeout

        for rid in many:  # none of them is ever completed
            with pytest.raises(TransferTimeout):
                receiver.receive_kv_cache_for_request(rid)
            assert receiver.health()["parts_waiting"] <= 8
    assert _shm_leftovers("kvtestparts") == []


def test_each_tp_rank_makes_its_connector_for_its_rank() -> None:
    # Issue 11, case 7: a fixed ZMQ port in the edge config, one KV manager per TP rank.
    cfg = KVTransferConfig(
        need_send_cache=True, stage_id=0, to_stage=1, connector="zmq", connector_config={"port": 47000}
    )
    managers = [KVTransferManager(cfg, num_kv_heads=2, tp_rank=r) for r in (0, 1)]
    try:
        assert [m.connector.port for m in managers] == [47000, 47001]
    finally:
        for m in managers:
            m.shutdown()


@pytest.mark.forked
@pytest.mark.slow
def test_state_stays_bounded_over_ten_thousand_requests() -> None:
    """Issue 11, case 10: the manager kept every received-but-never-popped KV and every
    prefetch that nobody consumed (a request aborted downstream), for ever. 10,000
    requests go through; a third are consumed, a third received and never popped, a third
    prefetched and never consumed. The state stays bounded and nothing is left in /dev/shm."""
    ns = "kvtest10k"
    caches = fake_cpu_caches(2, 7)
    plan = {"block_ids": [0], "seq_len": 3}
    send = _send_cfg("SharedMemoryConnector", connector_config={"namespace": ns})
    recv = _recv_cfg(
        "SharedMemoryConnector",
        {"namespace": ns},
        recv_timeout=10,
        enable_kv_async_prefetch=True,
        kv_prefetch_min_free_mem_ratio=0.0,
        max_unconsumed=64,
    )
    peak = {"received_waiting": 0, "prefetched": 0, "sender_info_entries": 0}
    with (
        KVTransferManager(send, num_kv_heads=2) as sender,
        KVTransferManager(recv, num_kv_heads=2) as receiver,
    ):
        for batch in range(100):  # 100 x 100 requests, sent in one call per batch
            ids = [f"r{batch * 100 + j}" for j in range(100)]
            assert (
                sender.handle_finished_requests_kv_transfer({rid: plan for rid in ids}, caches, BLOCK, "auto")
                == ids
            )
            assert _wait_finished(sender, len(ids)) == (set(ids), set())
            for i, rid in enumerate(ids):
                if i % 3 == 0:
                    data, _ = receiver.receive_kv_cache_for_request(rid)
                    assert data.request_id == rid
                elif i % 3 == 1:
                    receiver.receive_multi_kv_cache(rid)  # kept for a pop that never comes
                else:
                    receiver.start_prefetch([rid])  # consumed by nobody
            deadline = time.monotonic() + 10
            while receiver.prefetcher.in_flight() and time.monotonic() < deadline:
                time.sleep(0.001)
            health = {**receiver.health(), **sender.health()}
            for name in peak:
                peak[name] = max(peak[name], health[name])
        assert peak["received_waiting"] <= 64 and peak["prefetched"] <= 64, peak
        assert peak["sender_info_entries"] <= 4096, peak
        assert receiver.health()["metrics"]["recv"]["unconsumed_dropped"] > 0
    assert _shm_leftovers(ns) == []
