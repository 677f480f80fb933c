"""Per-step conditioning in a real vLLM engine (``payload.feed: per_step``).

One engine runs the built-in tiny talker with the kvbridge CPU worker and the gated
scheduler; this test process is the producer, putting chunks of rows with a real
:class:`PayloadSender` over shared memory. What the engine must do:

* run a request's positions only once their rows arrived: a request given the first
  chunk stops after exactly that many positions while another request of the batch runs
  on, and the engine core (the scheduler's process) sleeps while every request waits
  instead of stepping empty batches (counted by the worker; vLLM's CPU worker busy-polls
  its message queue whatever the scheduler does, so only the engine core's CPU says
  anything);
* give the same tokens and logprobs (bit-exact) as the run whose whole stream was there
  before it started, and the same tokens as transformers with the same conditioning;
* fail a request whose stream stalls, is aborted by its producer, or carries rows of the
  wrong width, with the reason, while the others finish; nothing is left in /dev/shm.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from runner_fixtures import shm_entries, shm_namespace, start_engine, stop_engine_and_reap

from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.models.tiny_talker import ensure_tiny_talker, reference_greedy
from vllm_kvbridge.runner.conditioning_scheduler import ERROR_KEY, IDLE_WAIT_S
from vllm_kvbridge.runner.payload_stream import PayloadSender

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "the module's vLLM engine starts in its first test"),
]

NS = shm_namespace("fd")
#: Two producers: stage 0 never stalls the tests (waits in them are far shorter), stage 2
#: is the one whose stream stalls.
STALL_S = 2.0
CHUNK = 4
DIM = 128  # the thinker's hidden size, the tiny talker's kvbridge_conditioning_dim


@pytest.fixture(scope="module")
def talker():
    model = ensure_tiny_talker()
    edge = {"mode": "async_chunk", "connector": "SharedMemoryConnector", "feed": "per_step"}
    edge["connector_config"] = {"namespace": NS}
    settings = {
        "stage_id": 1,
        "payload": {
            "inputs": [
                {"from_stage": 0, **edge, "recv_timeout_s": 60.0, "stall_timeout_s": 120.0},
                {"from_stage": 2, **edge, "recv_timeout_s": 60.0, "stall_timeout_s": STALL_S},
            ]
        },
    }
    llm = start_engine(model, settings)
    conn = create_connector("SharedMemoryConnector", {"namespace": NS})
    senders = {0: PayloadSender(conn, 0, 1), 2: PayloadSender(conn, 2, 1)}
    try:
        yield llm, senders, model
    finally:
        for sender in senders.values():
            sender.close()
        conn.close()
        stop_engine_and_reap(llm, settings)
    assert shm_entries(NS) == []


def _rows(seed: int, n: int = 12, dim: int = DIM) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def _add(llm: Any, rid: str, max_tokens: int, from_stage: int = 0) -> None:
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=1,
        extra_args={
            "kvbridge": {"request_id": rid, "condition": {"from_stage": from_stage, "transfer_id": rid}}
        },
    )
    bos = llm.llm_engine.model_config.hf_config.bos_token_id
    llm.llm_engine.add_request(rid, {"prompt_token_ids": [bos]}, params)


def _send(sender: PayloadSender, rid: str, rows: torch.Tensor, chunks: range, *, final: bool) -> None:
    for i in chunks:
        sender.send_chunk(rid, {"hidden_states": rows[i * CHUNK : (i + 1) * CHUNK]}, final=False)
    if final:
        sender.send_chunk(rid, None, final=True)


def _step_until(llm: Any, outputs: dict[str, Any], done: Any, timeout_s: float = 120.0) -> None:
    """Step the engine, keeping each request's latest output, until ``done(outputs)``."""
    end = time.monotonic() + timeout_s
    while not done(outputs):
        assert time.monotonic() < end, f"engine did not get there in {timeout_s} s: {outputs}"
        for o in llm.llm_engine.step():
            outputs[o.request_id] = o


def _tokens(o: Any) -> list[int]:
    return list(o.outputs[0].token_ids) if o.outputs else []


def _logprobs(o: Any) -> list[float]:
    comp = o.outputs[0]
    return [step[tok].logprob for step, tok in zip(comp.logprobs, comp.token_ids)]


def _idle(llm: Any, seconds: float) -> tuple[float, int]:
    """CPU seconds the engine-core process (not its workers) used in ``seconds``, and the
    engine steps its worker executed meanwhile."""
    import psutil

    procs = [psutil.Process(p.pid) for p in llm.llm_engine.engine_core.resources.engine_manager.processes]

    def total() -> tuple[float, int]:
        [state] = llm.collective_rpc("kvbridge_debug_state")
        return sum(sum(p.cpu_times()[:2]) for p in procs), int(state["steps"])

    cpu0, steps0 = total()
    time.sleep(seconds)
    cpu1, steps1 = total()
    return cpu1 - cpu0, steps1 - steps0


def test_a_request_waits_for_its_rows_without_holding_up_the_batch(talker) -> None:  # type: ignore[no-untyped-def]
    llm, senders, model = talker
    sender = senders[0]
    rows = _rows(1)
    # "whole": every row is there before it starts. "stream": only the first chunk.
    _send(sender, "whole", rows, range(3), final=True)
    time.sleep(0.2)  # let the chunks land (puts are asynchronous); not needed for correctness
    _send(sender, "stream", rows, range(1), final=False)
    _add(llm, "whole", 10)
    _add(llm, "stream", 10)
    outputs: dict[str, Any] = {}
    _step_until(llm, outputs, lambda o: "whole" in o and o["whole"].finished)
    # Positions 0..3 had rows: 4 tokens, then it waited while "whole" ran its 6 more steps.
    assert _tokens(outputs["stream"]) == _tokens(outputs["whole"])[:CHUNK]
    assert not outputs["stream"].finished
    # Every request waits now: the engine core sleeps on the feed (IDLE_WAIT_S at a time)
    # instead of stepping empty batches (vLLM alone: one per millisecond; an RPC round trip
    # to the worker each). vLLM's CPU worker busy-polls its message queue whatever the
    # scheduler does, so only the engine core's CPU and the step count say anything.
    cpu, steps = _idle(llm, 2.0)
    assert cpu < 0.5, f"the engine core used {cpu:.2f} s of CPU in 2 s while waiting"
    assert steps <= 2 + 2.0 / IDLE_WAIT_S, f"{steps} empty engine steps in 2 s while every request waited"
    _send(sender, "stream", rows, range(1, 3), final=True)
    _step_until(llm, outputs, lambda o: o["stream"].finished)
    assert _tokens(outputs["stream"]) == _tokens(outputs["whole"])
    assert _logprobs(outputs["stream"]) == _logprobs(outputs["whole"])  # bit-exact
    assert _tokens(outputs["whole"]) == reference_greedy(model, rows, [_bos(llm)], 10)
    # Past the end of the stream (12 rows) positions get zeros: still what transformers says.
    _send(sender, "short", rows[:6], range(2), final=True)
    _add(llm, "short", 10)
    _step_until(llm, outputs, lambda o: "short" in o and o["short"].finished)
    assert _tokens(outputs["short"]) == reference_greedy(model, rows[:6], [_bos(llm)], 10)


def _bos(llm: Any) -> int:
    return int(llm.llm_engine.model_config.hf_config.bos_token_id)


def _error(o: Any) -> str:
    assert o.finished and o.outputs[0].finish_reason == "error", o
    return str((o.kv_transfer_params or {}).get(ERROR_KEY))


def test_a_stalled_aborted_or_malformed_stream_fails_its_request_alone(talker) -> None:  # type: ignore[no-untyped-def]
    llm, senders, model = talker
    sender = senders[0]
    rows = _rows(2)
    _send(sender, "ok", rows, range(3), final=True)
    _send(senders[2], "stalls", rows, range(1), final=False)
    _send(sender, "aborted", rows, range(1), final=False)
    sender.abort("aborted", "the thinker was aborted", chunked=True)
    _send(sender, "narrow", _rows(3, dim=DIM // 2), range(1), final=False)
    t0 = time.monotonic()
    for rid in ("ok", "stalls", "aborted", "narrow"):
        _add(llm, rid, 10, from_stage=2 if rid == "stalls" else 0)
    outputs: dict[str, Any] = {}
    _step_until(llm, outputs, lambda o: len(o) == 4 and all(x.finished for x in o.values()))
    assert _tokens(outputs["ok"]) == reference_greedy(model, rows, [_bos(llm)], 10)
    stalled = _error(outputs["stalls"])
    assert "chunk 1" in stalled and "stalled" in stalled, stalled
    assert time.monotonic() - t0 >= STALL_S - 0.5
    assert "the thinker was aborted" in _error(outputs["aborted"])
    assert "width 64" in _error(outputs["narrow"]) and "128" in _error(outputs["narrow"])
    # The stalled request ran its 4 positions and no more.
    assert len(_tokens(outputs["stalls"])) <= CHUNK
    # Nothing left behind: every chunk put was read (the engine forgot each stream).
    assert all(s.in_flight() == 0 for s in senders.values())
    assert sender.connector.health()["published"] == 0
