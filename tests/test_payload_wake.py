"""A consumer wakes on the arrival of its payload, not on a timer (issue 13, handoff latency).

Pinned on the code path, never on timings: the receiver's poll timer is set far beyond the
test's hang guards, so only the sender's doorbell can deliver in time; the LLM stage's serve
loop is not asked to step (``busy()`` False) while a payload is on its way, and the
arrival makes its waker readable.
"""

from __future__ import annotations

import os
import select
import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from pipeline_fixtures import ROOT

from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.runner import payload_receiver
from vllm_kvbridge.runner.doorbell import BELL_KEY, BellListener
from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
from vllm_kvbridge.runner.payload_stream import PayloadSender

pytestmark = pytest.mark.forked

#: the receivers' poll timer: far beyond every wait here, so it never finds a payload
NEVER_S = 600.0


class _SpyListener(BellListener):
    rung: list[str] = []

    def wait(self, timeout: float) -> tuple[bool, list[str]]:
        woken, keys = super().wait(timeout)
        _SpyListener.rung.extend(keys)
        return woken, keys


def _until(pred: Any, what: str, timeout: float = 30.0, ring: Any = None) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"{what} not within {timeout} s")
        if ring is not None:
            ring()
        time.sleep(0.01)


@pytest.fixture
def shm_pair():
    ns = f"wake{os.getpid()}"
    out = create_connector("SharedMemoryConnector", {"namespace": ns})
    inp = create_connector("SharedMemoryConnector", {"namespace": ns})
    yield ns, out, inp
    out.close()
    inp.close()


def test_the_receiver_is_woken_by_the_senders_doorbell(shm_pair, monkeypatch) -> None:
    monkeypatch.setattr(payload_receiver, "BellListener", _SpyListener)
    _SpyListener.rung = []
    _, out, inp = shm_pair
    sender = PayloadSender(out, 0, 1)
    rx = PayloadReceiver(inp, 0, 1, poll_interval_s=NEVER_S, max_poll_interval_s=NEVER_S)
    try:
        info = sender.receiver_info()
        assert info[BELL_KEY].startswith("udp://127.0.0.1:")
        rx.expect("r1", metadata=info)  # subscribes to the bell; one try now, the next in NEVER_S
        # A subscription takes effect asynchronously: ring until the receiver hears one.
        _until(
            lambda: "probe" in _SpyListener.rung, "the subscription", ring=lambda: sender._bell.ring("probe")
        )
        sender.send_full("r1", {"h": torch.arange(6.0).reshape(2, 3)})
        got = rx.result("r1", timeout=60)
        assert torch.equal(got["h"], torch.arange(6.0).reshape(2, 3))
        assert sender.key("r1", None) in _SpyListener.rung  # delivered on its ring
    finally:
        rx.close()
        sender.close()


def test_the_receiver_still_finds_a_payload_without_a_doorbell(shm_pair) -> None:
    """A lost ring, a sender elsewhere: the poll timer is the fallback."""
    _, out, inp = shm_pair
    sender = PayloadSender(out, 0, 1, bell=False)
    rx = PayloadReceiver(inp, 0, 1, poll_interval_s=0.001, max_poll_interval_s=0.02)
    try:
        assert BELL_KEY not in sender.receiver_info()
        rx.expect("r2", metadata=sender.receiver_info() or None)
        sender.send_full("r2", {"h": torch.ones(1, 2)})
        payload, timing = rx.result_timed("r2", timeout=60)
        assert torch.equal(payload["h"], torch.ones(1, 2))
        # the transfer (the gets) is part of the whole wait, which ended when it was ready
        assert 0 < timing.get_s <= timing.waited_s and timing.ready_at > 0
    finally:
        rx.close()
        sender.close()


class _StubEngine:
    def __init__(self) -> None:
        self.added: list[tuple[str, Any]] = []
        self.engine_core = SimpleNamespace(shutdown=lambda: None)

    def add_request(self, rid: str, prompt: Any, params: Any) -> None:
        self.added.append((rid, prompt))

    def has_unfinished_requests(self) -> bool:
        return False

    def abort_request(self, ids: Any) -> None:
        pass


class _StubLLM:
    """Stands in for vllm.LLM: the stage engine's payload wait is what is tested here."""

    def __init__(self, **kwargs: Any) -> None:
        self.llm_engine = _StubEngine()

    def collective_rpc(self, method: str, args: Any = ()) -> list[Any]:
        return [{}]


def _readable(fd: int, timeout: float) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


def test_an_llm_stage_waiting_for_its_payload_sleeps_until_it_lands(monkeypatch) -> None:
    import vllm

    from vllm_kvbridge.config.resolve import resolve
    from vllm_kvbridge.pipeline.llm_engine import LLMStageEngine
    from vllm_kvbridge.pipeline.stage_handles import with_run_namespaces

    monkeypatch.setattr(vllm, "LLM", _StubLLM)
    stage = resolve(ROOT / "stage_configs/thinker_talker_full_payload.yaml").stages[1]
    stage = msgspec.structs.replace(with_run_namespaces(stage, f"wake{os.getpid()}"), model="stub")
    (edge,) = stage.inputs
    engine = LLMStageEngine(stage)
    out = create_connector(edge.connector.name, edge.connector.config)
    sender = PayloadSender(out, 0, 1)
    try:
        waker = engine.waker()
        assert waker is not None
        up = m.Upstream(0, "t1", {"payload": {"1": sender.receiver_info()}})
        engine.submit(m.Submit("t1", upstream=[up]))
        # On its way: nothing to step, so the serve loop sleeps instead of spinning.
        assert not engine.busy() and not _readable(waker.fileno(), 0)
        embeds = torch.randn(5, 8)
        sender.send_full("t1", {"hidden_states": embeds})
        assert _readable(waker.fileno(), 60)  # the arrival rang it
        waker.clear()
        assert engine.busy()
        assert engine.step() == []
        [(rid, prompt)] = engine.llm.llm_engine.added
        assert rid == "t1" and torch.equal(prompt["prompt_embeds"], embeds)
        assert not engine.busy() and not _readable(waker.fileno(), 0)
    finally:
        sender.close()
        out.close()
        engine.close()


def test_a_bell_of_another_host_is_not_subscribed() -> None:
    """A bell endpoint names its host and network namespace: a receiver elsewhere would send
    its subscription to its *own* loopback (whatever listens there), so it must not."""
    import socket

    from vllm_kvbridge.runner.doorbell import host_id

    local = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # whatever listens on this loopback
    local.bind(("127.0.0.1", 0))
    local.settimeout(0.5)
    port = local.getsockname()[1]
    listener = BellListener()
    try:
        listener.subscribe(f"udp://127.0.0.1:{port}?host=another-boot.4026531840")
        listener.subscribe(f"udp://127.0.0.1:{port}")  # no host named: not known to be here
        # Same endpoint on this host (the positive control): the subscription arrives.
        listener.subscribe(f"udp://127.0.0.1:{port}?host={host_id()}")
        msg, _ = local.recvfrom(64)
        assert msg == b"\0sub"
        # Only that one: the two foreign endpoints sent nothing before it (UDP on loopback
        # keeps one socket's order) and nothing after.
        with pytest.raises(TimeoutError):
            local.recvfrom(64)
    finally:
        listener.close()
        local.close()
