"""Hidden-state payloads captured by a real vLLM engine (kvbridge CPU worker).

One engine, started in the order vLLM's GPU worker starts it (CUDA-graph memory profiling
builds a minimal KV cache before the KV connector exists), two payload edges from stage 0:
``full`` to stage 1 and ``async_chunk`` (every 4 steps) to stage 2. This test process is
both receivers. The producer's payload is checked against vLLM's own output (token ids,
bit-exact), against transformers (final-norm hidden states, float32 tolerance) and full
against the concatenated chunks (bit-exact). An aborted request must fail its receivers
and leave no state, thread or key.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from runner_fixtures import (
    GPU_START_ORDER_WORKER,
    HFReference,
    prompt_ids,
    shm_entries,
    shm_namespace,
    start_engine,
    stop_engine_and_reap,
)

from vllm_kvbridge.connectors.registry import create_connector
from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
from vllm_kvbridge.runner.payload_stream import SEND_WORKERS, PayloadAborted

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "the module's vLLM engine starts in its first test"),
]

NS_FULL, NS_CHUNK = shm_namespace("pf"), shm_namespace("pc")
CHUNK = 4


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    edge = {"connector": "SharedMemoryConnector"}
    settings = {
        "stage_id": 0,
        "payload": {
            "capture_hidden_states": True,
            "outputs": [
                {"to_stage": 1, "mode": "full", **edge, "connector_config": {"namespace": NS_FULL}},
                {
                    "to_stage": 2,
                    "mode": "async_chunk",
                    "chunk_size": CHUNK,
                    **edge,
                    "connector_config": {"namespace": NS_CHUNK},
                },
            ],
        },
    }
    # Started as vLLM's GPU worker starts a runner (CUDA-graph memory profiling first).
    llm = start_engine(tiny_model_dir, settings, worker_cls=GPU_START_ORDER_WORKER)
    conns = [create_connector("SharedMemoryConnector", {"namespace": ns}) for ns in (NS_FULL, NS_CHUNK)]
    full = PayloadReceiver(conns[0], 0, 1, mode="full", recv_timeout_s=60)
    chunks = PayloadReceiver(conns[1], 0, 2, mode="async_chunk", recv_timeout_s=60, stall_timeout_s=60)
    try:
        yield llm, full, chunks
    finally:
        full.close()
        chunks.close()
        for c in conns:
            c.close()
        _, reaped = stop_engine_and_reap(llm, settings)
    # The last test SIGKILLs the worker: its pool segments were removed by the engine
    # core's own shutdown (scheduler-side connector); nothing was left for a later reap.
    assert reaped == []
    assert shm_entries(NS_FULL) == [] and shm_entries(NS_CHUNK) == []


def _params(rid: str, max_tokens: int, **extra: object):
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        extra_args={"kvbridge": {"request_id": rid}},
        **extra,
    )


def test_full_and_async_chunk_payloads_carry_the_hidden_states(engine, tiny_model_dir: Path) -> None:
    from vllm.inputs import TokensPrompt

    llm, full, chunks = engine
    ids = prompt_ids(21, salt=3)
    max_tokens = 10
    full.expect("hs")
    chunks.expect("hs")
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], _params("hs", max_tokens), use_tqdm=False)[0]
    generated = list(out.outputs[0].token_ids)

    payload = full.result("hs", timeout=60)
    parts = list(chunks.iter_chunks("hs", timeout=60))
    # Token ids: exactly what vLLM generated.
    assert payload["token_ids"].tolist() == generated
    # Hidden states: one row per prompt token and per generated token except the last.
    hidden = payload["hidden_states"]
    assert hidden.shape == (len(ids) + max_tokens - 1, 128) and hidden.dtype == torch.float32
    ref = HFReference(tiny_model_dir).hidden(ids + generated[:-1])
    assert (hidden - ref).abs().max().item() <= 1e-4
    # Async chunks: one per CHUNK steps (the first includes the prefill), in order, and
    # their concatenation is bit-exact the full payload.
    assert len(parts) == -(-max_tokens // CHUNK)
    assert [p["token_ids"].numel() for p in parts] == [CHUNK, CHUNK, max_tokens - 2 * CHUNK]
    assert torch.equal(torch.cat([p["hidden_states"] for p in parts]), hidden)
    assert torch.equal(torch.cat([p["token_ids"] for p in parts]), payload["token_ids"])

    status = llm.collective_rpc("kvbridge_transfer_status", args=(["hs"],))[0]["hs"]
    assert status["payload"] == "done", status
    info = llm.collective_rpc("kvbridge_sender_info")[0]
    assert info["stage_id"] == 0 and set(info["payload"]) == {"1", "2"}


def test_a_batch_of_captured_requests_leaves_the_device_in_one_copy_per_step(
    engine, tiny_model_dir: Path
) -> None:
    """#14 item 2: the rows of every captured request of a step go to the host together
    (one copy per step, not one per request), and each request still gets exactly its own."""
    from vllm.inputs import TokensPrompt

    llm, full, chunks = engine
    rids, max_tokens = ["b0", "b1", "b2"], 6
    prompts = {rid: prompt_ids(9 + 4 * i, salt=40 + i) for i, rid in enumerate(rids)}
    for rid in rids:
        full.expect(rid)
        chunks.expect(rid)
    before = llm.collective_rpc("kvbridge_debug_state")[0]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=prompts[r]) for r in rids],
        [_params(r, max_tokens) for r in rids],
        use_tqdm=False,
    )
    after = llm.collective_rpc("kvbridge_debug_state")[0]
    hf = HFReference(tiny_model_dir)
    for rid, out in zip(rids, outs, strict=True):
        generated = list(out.outputs[0].token_ids)
        payload = full.result(rid, timeout=60)
        list(chunks.iter_chunks(rid, timeout=60))
        ref = hf.hidden(prompts[rid] + generated[:-1])
        assert payload["hidden_states"].shape == ref.shape
        assert (payload["hidden_states"] - ref).abs().max().item() <= 1e-4
    copies = after["capture_row_copies"] - before["capture_row_copies"]
    steps = after["steps"] - before["steps"]
    # The three run in the same steps (they fit one batch): at most one copy per step,
    # where one per request would be three per step.
    assert 0 < copies <= steps < len(rids) * max_tokens, (copies, steps)


def test_aborted_request_fails_receivers_and_leaves_nothing(engine) -> None:
    from vllm.inputs import TokensPrompt

    llm, full, chunks = engine
    full.expect("ab")
    chunks.expect("ab")
    engine_ = llm.llm_engine
    engine_.add_request("ab-req", TokensPrompt(prompt_token_ids=prompt_ids(9)), _params("ab", 400))
    tokens = 0
    deadline = time.monotonic() + 60
    while tokens < 2 * CHUNK + 1 and time.monotonic() < deadline:
        for o in engine_.step():
            tokens = len(o.outputs[0].token_ids)
    assert tokens > 2 * CHUNK
    engine_.abort_request(["ab-req"])
    with pytest.raises(PayloadAborted, match="aborted"):
        list(chunks.iter_chunks("ab", timeout=60))
    with pytest.raises(PayloadAborted, match="aborted"):
        full.result("ab", timeout=60)

    end = time.monotonic() + 30
    while True:
        state = llm.collective_rpc("kvbridge_debug_state")[0]
        if not state["requests"] or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert state["requests"] == [] and state["accumulators"] == [], state
    assert state["payload_in_flight"] == {"1": 0, "2": 0}
    assert state["payload_tracked"] == {"1": [], "2": []}
    # Only the two edges' long-lived sender pools (+ the shm reapers), nothing per request.
    senders = sorted(t for t in state["threads"] if "payload" in t)
    assert {t.rsplit("-", 1)[0] for t in senders} == {"kvbridge-payload-send-1", "kvbridge-payload-send-2"}
    assert len(senders) == 2 * SEND_WORKERS, senders
    assert llm.collective_rpc("kvbridge_transfer_status", args=(["ab"],))[0]["ab"]["payload"] == "aborted"
    for ns in (NS_FULL, NS_CHUNK):
        assert [e for e in shm_entries(ns) if ".k." in e] == []


def test_capture_after_a_prefix_cache_hit_fails_loudly_or_is_exact(engine, tiny_model_dir: Path) -> None:
    """Issue 11, case 2: a prompt sharing a cached block with an earlier one was scheduled
    from the end of the cached prefix, so its payload silently missed those rows."""
    from vllm.inputs import TokensPrompt

    llm, full, chunks = engine
    shared = prompt_ids(40, salt=7)  # block_size 32: one full block is shared
    first, second = shared + prompt_ids(5, salt=8), shared + prompt_ids(6, salt=9)

    def run(rid: str, ids: list[int], **extra: object) -> list[int]:
        full.expect(rid)
        chunks.expect(rid)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], _params(rid, 3, **extra), use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    run("px1", first)  # fills the prefix cache
    assert full.result("px1", timeout=60)["hidden_states"].shape[0] == len(first) + 2
    list(chunks.iter_chunks("px1", timeout=60))

    # A prefix-cache hit: the request fails, its receivers are told why, nothing is short.
    run("px2", second)
    with pytest.raises(PayloadAborted, match="prefix"):
        full.result("px2", timeout=60)
    with pytest.raises(PayloadAborted, match="prefix"):
        list(chunks.iter_chunks("px2", timeout=60))
    status = llm.collective_rpc("kvbridge_transfer_status", args=(["px2"],))[0]["px2"]
    assert status["payload"].startswith("failed") and "prefix" in status["payload"], status

    # Skipping the prefix cache (what the pipeline does for capturing stages): exact.
    generated = run("px3", second, skip_reading_prefix_cache=True)
    hidden = full.result("px3", timeout=60)["hidden_states"]
    assert hidden.shape[0] == len(second) + 2
    ref = HFReference(tiny_model_dir).hidden(second + generated[:-1])
    assert (hidden - ref).abs().max().item() <= 1e-4
    assert torch.equal(torch.cat([p["hidden_states"] for p in chunks.iter_chunks("px3", timeout=60)]), hidden)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed child stays a zombie until its parent waits)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_zz_killed_worker_leaves_nothing_after_the_engine_stopped(engine) -> None:
    """Runs last (the engine is dead afterwards); the check is in the fixture's teardown.

    The engine core (the worker's parent) reaps a dead worker's segments in its shutdown.
    It is stopped while the worker is killed, so "the killed worker removed nothing
    itself" is checked before anyone else could act (issue 11, case 15: this raced the
    engine core's reaper), then resumed, failed by the next request (or first by its
    executor's worker monitor), and waited for until it exited by itself (the fixture's
    stop would otherwise race its shutdown).
    """
    llm, _, _ = engine
    pid = llm.collective_rpc("kvbridge_debug_state")[0]["pid"]
    core = _parent(pid)
    assert core not in (os.getpid(), 1), core  # the engine-core process, never us
    # The worker holds pool segments of both edges (kept for reuse after the tests above).
    for ns in (NS_FULL, NS_CHUNK):
        assert any(f".p.{pid}." in e for e in shm_entries(ns)), shm_entries(ns)
    os.kill(core, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 30
        while _running(pid) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _running(pid)
        assert any(f".p.{pid}." in e for e in shm_entries(NS_FULL))  # SIGKILL: nothing ran
    finally:
        os.kill(core, signal.SIGCONT)
    # The next request fails the engine core (its executor lost the worker: "Executor
    # failed"), which then shuts down by itself, its connector reaping the dead worker's
    # names. Sent on a thread: the executor's worker monitor may fail the engine core first,
    # and a request sent while it dies can wait forever in vLLM's client (never answered).
    failed: list[BaseException] = []

    def next_request() -> None:
        try:
            llm.collective_rpc("kvbridge_debug_state")
        except BaseException as exc:  # vLLM's error type for a dead engine varies
            failed.append(exc)

    threading.Thread(target=next_request, daemon=True).start()
    end = time.monotonic() + 60
    while _running(core) and time.monotonic() < end:
        time.sleep(0.1)
    assert not _running(core)
