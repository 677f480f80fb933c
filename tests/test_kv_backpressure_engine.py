"""Issue 15 item 2 in a real vLLM engine: a full edge holds finished requests' KV in the
engine's blocks, and nothing is lost or overwritten meanwhile.

The edge (shared memory) holds two requests' KV at most (``max_held_bytes`` = two 64 KiB
segments: the tiny model's KV of 43 tokens is 43 KiB) and the send queue takes one
request (``max_send_queue_bytes: 1``). With nobody reading, six finished requests end in
a state that no timing changes: two delivered, the third's put waiting for room, three
held in the engine's blocks. Then a flood that needs more blocks than are free runs
while a receiver reads the six: each KV equals transformers' (the held blocks were not
reused), and the flood completes once the held blocks go back.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest
from runner_fixtures import (
    HFReference,
    assert_kv_equal,
    kv_params,
    kv_receiver,
    kv_sender_settings,
    prompt_ids,
    shm_entries,
    shm_namespace,
    start_engine,
    stop_engine_and_reap,
    tokens_prompt,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "the module's vLLM engine starts in its first test"),
]

NAMESPACE = shm_namespace("bpengine")
SEGMENT = 64 << 10  # the smallest shm segment: one request's KV here
KV_REQUESTS = [f"bp{i}" for i in range(6)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    settings = kv_sender_settings(NAMESPACE)
    settings["kv_transfer"]["connector_config"]["max_held_bytes"] = 2 * SEGMENT
    settings["kv_transfer"]["max_send_queue_bytes"] = 1
    settings["kv_transfer"]["send_timeout"] = 300.0  # nothing here may time out
    llm = start_engine(tiny_model_dir, settings, num_gpu_blocks_override=24, max_num_seqs=16)
    try:
        yield llm
    finally:
        killed, reaped = stop_engine_and_reap(llm, settings)
    assert not reaped or killed, reaped
    assert shm_entries(NAMESPACE) == []


def _state(llm) -> dict:
    return llm.collective_rpc("kvbridge_debug_state")[0]


def _statuses(llm) -> dict[str, str]:
    status = llm.collective_rpc("kvbridge_transfer_status", args=(KV_REQUESTS,))[0]
    return {rid: s["kv"] for rid, s in status.items()}


def test_a_full_edge_holds_kv_in_the_engine_and_delivers_all_of_it(engine, tiny_model_dir) -> None:
    llm = engine
    ids = {rid: prompt_ids(40, salt=100 + i) for i, rid in enumerate(KV_REQUESTS)}
    outs = llm.generate([tokens_prompt(ids[r]) for r in KV_REQUESTS], [kv_params(r, 3) for r in KV_REQUESTS])
    generated = {r: list(o.outputs[0].token_ids) for r, o in zip(KV_REQUESTS, outs)}
    assert all(o.kv_transfer_params["kvbridge_kv"] == "submitted" for o in outs)

    # Nobody reads: the engine steps on (vLLM keeps stepping while blocks wait for the
    # connector) until two sends landed, one waits for room and three are held.
    end = time.monotonic() + 60
    while True:
        state, status = _state(llm), _statuses(llm)
        done = sorted(r for r, s in status.items() if s == "done")
        if len(done) == 2 and state["kv_held"] == 3:
            break
        assert time.monotonic() < end, (status, state)
        time.sleep(0.05)
    assert all(s == "pending" for r, s in status.items() if r not in done), status
    assert state["kv_queued_bytes"] > 0 and state["kv_edge"]["put_full"] >= 1, state
    assert state["kv_edge"]["held_bytes"] == 2 * SEGMENT, state
    assert len(state["kv_live"]) == 4, state  # the waiting put and the three held

    # A flood that needs more blocks than are free, while a receiver reads the six KVs.
    # Each is checked and dropped at once: a read segment goes back to the edge only when
    # the tensors that view it are freed.
    hf = HFReference(tiny_model_dir)
    want = {rid: hf.kv(ids[rid] + generated[rid][:-1]) for rid in KV_REQUESTS}
    checked: list[str] = []
    errors: list[BaseException] = []

    def read_all() -> None:
        receiver = kv_receiver(NAMESPACE, timeout=120)
        try:
            for rid in KV_REQUESTS:
                data, _ = receiver.receive_kv_cache_for_request(rid)
                assert_kv_equal(data, want[rid])
                del data
                receiver.pop_received(rid)
                gc.collect()
                checked.append(rid)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            receiver.shutdown()

    reader = threading.Thread(target=read_all)
    reader.start()
    flood = [tokens_prompt(prompt_ids(60 + 7 * j, salt=300 + j)) for j in range(10)]
    flood_outs = llm.generate(flood, [kv_params(f"fl{j}", 24, send_kv=False) for j in range(10)])
    reader.join(180)
    assert not reader.is_alive() and not errors, errors
    assert checked == KV_REQUESTS
    assert all(len(o.outputs[0].token_ids) == 24 for o in flood_outs)
    assert set(_statuses(llm).values()) == {"done"}
    state = _state(llm)
    assert state["kv_held"] == 0 and state["kv_live"] == [] and state["kv_queued_bytes"] == 0, state
