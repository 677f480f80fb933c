"""KV sent by a real vLLM engine on vLLM's stock CPU worker equals transformers' past_key_values.

One engine for the whole module (engines take ~30 s to start here). The sender is the
engine's worker process; the receiver is this test process (a KV manager of "stage 1" on
the same shared-memory edge). Triggers are chosen per request through
``extra_args["kvbridge"]`` so one engine covers on_finish, prefill_finished (with and
without stop_after_transfer) and special_token. The KV cache is kept small
(``num_gpu_blocks_override``) so freed blocks are reused at once under load.

The engine sends on the staged path (issue 14, the GPU default; ``staging_bytes``): the
gathers of finished requests run on the copy thread while the engine steps on, and their
blocks go back only once the copy read them; a small pool can make finished requests wait
in their blocks for room under the concurrency test, where the flood reuses every block
given back. (That ordering is checked deterministically, with a stalled copy, in
test_kv_staging.py.) The direct path in a real engine is covered by the pipeline tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from runner_fixtures import (
    HFReference,
    assert_kv_equal,
    kv_params,
    kv_receiver,
    kv_sender_settings,
    prompt_ids,
    settled_status,
    shm_entries,
    shm_namespace,
    start_engine,
    stop_engine_and_reap,
    tokens_prompt,
)

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.long(300, "the module's vLLM engines start in its first tests"),
]

LENGTHS = [1, 127, 128, 129, 300]
NAMESPACE = shm_namespace("kv")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    settings = kv_sender_settings(NAMESPACE)
    settings["kv_transfer"]["staging_bytes"] = 4 << 20  # room for four requests at once
    llm = start_engine(tiny_model_dir, settings, num_gpu_blocks_override=96, max_num_seqs=16)
    receiver = kv_receiver(NAMESPACE)
    try:
        yield llm, receiver
    finally:
        receiver.shutdown()
        killed, reaped = stop_engine_and_reap(llm, settings)
    # vLLM's own shutdown path (SIGTERM to the engine core, death pipe to the worker)
    # released the worker's pool segments (unless vLLM had to SIGKILL the engine core on a
    # loaded machine: then they were reapable): nothing of the edge is left.
    assert not reaped or killed, reaped
    assert shm_entries(NAMESPACE) == []


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> HFReference:
    return HFReference(tiny_model_dir)


def test_the_engine_runs_vllms_stock_worker_and_runner(engine) -> None:
    """Issue 12: a stage that only sends KV needs nothing of kvbridge in vLLM's worker or
    runner; the KV connector (given in kv_transfer_config) gathers and sends."""
    llm, _ = engine
    [state] = llm.collective_rpc("kvbridge_debug_state")
    assert state["worker_cls"] == "vllm.v1.worker.cpu_worker.CPUWorker", state
    assert state["model_runner_cls"] == "CPUModelRunner", state
    worker_cls = llm.llm_engine.vllm_config.parallel_config.worker_cls
    assert worker_cls in ("auto", "vllm.v1.worker.cpu_worker.CPUWorker"), worker_cls


def test_on_finish_every_length_exact_without_follow_up_traffic(engine, hf) -> None:
    llm, receiver = engine
    for n in LENGTHS:
        ids = prompt_ids(n)
        rid = f"fin{n}"
        # One request alone; nothing is submitted after it, so the KV must leave on its own.
        out = llm.generate([tokens_prompt(ids)], kv_params(rid, 3), use_tqdm=False)[0]
        generated = list(out.outputs[0].token_ids)
        assert out.kv_transfer_params["kvbridge_kv"] == "submitted"
        data, nbytes = receiver.receive_kv_cache_for_request(rid)
        assert nbytes > 0 and data.request_id == rid
        # The last sampled token is never fed back, so its KV does not exist.
        assert_kv_equal(data, hf.kv(ids + generated[:-1]))
    rids = [f"fin{n}" for n in LENGTHS]
    status = settled_status(lambda ids: llm.collective_rpc("kvbridge_transfer_status", args=(ids,))[0], rids)
    assert all(s["kv"] == "done" for s in status.values()), status


def test_prefill_finished_sends_the_prompt_kv(engine, hf) -> None:
    llm, receiver = engine
    for n in LENGTHS:
        ids = prompt_ids(n, salt=1)
        stop = n % 2 == 1  # both variants across the lengths
        rid = f"pf{n}"
        out = llm.generate(
            [tokens_prompt(ids)],
            kv_params(rid, 5, trigger="prefill_finished", stop_after_transfer=stop),
            use_tqdm=False,
        )[0]
        assert len(out.outputs[0].token_ids) == (1 if stop else 5)
        data, _ = receiver.receive_kv_cache_for_request(rid)
        assert_kv_equal(data, hf.kv(ids))


def test_special_token_sends_kv_before_the_trigger(engine, hf) -> None:
    llm, receiver = engine
    ids = prompt_ids(40, salt=2)
    plain = llm.generate([tokens_prompt(ids)], kv_params("probe", 6, send_kv=False), use_tqdm=False)[0]
    tokens = list(plain.outputs[0].token_ids)
    trigger = tokens[3]
    index = tokens.index(trigger)  # first occurrence
    out = llm.generate(
        [tokens_prompt(ids)],
        kv_params("sp", 6, trigger="special_token", trigger_token_id=trigger),
        use_tqdm=False,
    )[0]
    assert list(out.outputs[0].token_ids) == tokens
    data, _ = receiver.receive_kv_cache_for_request("sp")
    assert_kv_equal(data, hf.kv(ids + tokens[:index]))
    # A trigger that is never sampled sends nothing, and says so.
    missing = next(t for t in range(VOCAB_SAFE, 500) if t not in tokens)
    out = llm.generate(
        [tokens_prompt(ids)],
        kv_params("sp-miss", 6, trigger="special_token", trigger_token_id=missing),
        use_tqdm=False,
    )[0]
    assert out.kv_transfer_params["kvbridge_kv"] == "trigger_not_sampled"


VOCAB_SAFE = 5


def test_exact_under_block_reuse_pressure_and_concurrency(engine, hf) -> None:
    llm, receiver = engine
    lengths = [1, 31, 32, 33, 127, 128, 129, 300]
    prompts, params = [], []
    for i, n in enumerate(lengths):  # 8 concurrent KV requests, short generations
        prompts.append(tokens_prompt(prompt_ids(n, salt=10 + i)))
        params.append(kv_params(f"cc{i}", 2 + i % 3))
    for j in range(24):  # flood: longer generations that take every block freed meanwhile
        prompts.append(tokens_prompt(prompt_ids(60 + 7 * j, salt=50 + j)))
        params.append(kv_params(f"flood{j}", 24, send_kv=False))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, n in enumerate(lengths):
        generated = list(outs[i].outputs[0].token_ids)
        data, _ = receiver.receive_kv_cache_for_request(f"cc{i}")
        assert_kv_equal(data, hf.kv(prompt_ids(n, salt=10 + i) + generated[:-1]))
    state = llm.collective_rpc("kvbridge_debug_state")[0]
    assert state["kv_live"] == [] and state["kv_pending"] == 0, state
    staging = state["kv_staging"]  # every send went through the pool, and all of it came back
    assert staging is not None and staging["in_use"] == 0 and staging["bypassed"] == 0, staging
    assert [e for e in shm_entries(NAMESPACE) if ".k." in e] == []
