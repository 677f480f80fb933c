"""Hidden-state capture on vLLM's Model Runner V2, with synchronous and async scheduling
(issue 12, items 3 and 4).

V2 (``vllm/v1/worker/gpu/model_runner.py``) needs Triton and CUDA, and the CPU platform
forces async scheduling off, so neither runs in an engine here. This test runs what they
do around our code: vLLM's real scheduler (``Scheduler`` or ``AsyncScheduler``) with the
scheduler half of our connector, vLLM's V2 connector wrapper (``ActiveKVConnector``)
around the worker half, and :class:`KVBridgeV2ARModelRunner`'s capture hook, given per step
a real V2 ``ExecuteModelState`` with a real ``InputBatch`` laid out as V2 lays it out
(``sort_batch_req_ids`` order, ``query_start_loc_np``, ``num_computed_tokens_np`` from the
scheduler output). V2's ``__init__`` needs CUDA, so the runner object is built without it;
the hook is the code our ``sample_tokens`` override runs before vLLM's own.

The test plays the model: the hidden row of request ``r`` at position ``p`` is a known
function of ``(r, p)``, and the token sampled there too. Async scheduling runs the engine
core's batch queue (step ``k + 1`` is scheduled before step ``k``'s output arrives), so a
request that samples its stop token still runs one more forward: its row and token must not
reach the payload. Preemption (few blocks) and chunked prefill (small token budget) make
rows be recomputed and split. Each request's payload (full, and async chunks) must be
exactly its rows for positions ``0 .. prompt + generated - 2`` and its generated tokens,
also when the step's ``wait_for_save`` (where the connector hands the scheduler's tokens
to the runner) runs in vLLM 0.33's ``finalize_step`` after ``post_forward(...,
defer_finalize=True)`` (``test_runner_v2_connector.end_step``).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch
from runner_fixtures import shm_entries, shm_namespace
from scheduler_fixtures import make_scheduler
from test_runner_v2_connector import FINALIZE, end_step

NS_FULL, NS_CHUNK = shm_namespace("v2f"), shm_namespace("v2c")
CHUNK = 3
HIDDEN = 6
STOP = 7
LAYER = "model.layers.0.self_attn.attn"
BLOCK = 32

SETTINGS = {
    "stage_id": 0,
    "payload": {
        "capture_hidden_states": True,
        "outputs": [
            {
                "to_stage": 1,
                "mode": "full",
                "connector": "SharedMemoryConnector",
                "connector_config": {"namespace": NS_FULL},
            },
            {
                "to_stage": 2,
                "mode": "async_chunk",
                "chunk_size": CHUNK,
                "connector": "SharedMemoryConnector",
                "connector_config": {"namespace": NS_CHUNK},
            },
        ],
    },
}

#: request -> (prompt length, max tokens, output index at which it samples STOP or None)
REQUESTS = {
    "long": (150, 9, None),  # chunked prefill (token budget 64)
    "stops": (60, 20, 10),  # samples STOP as its 11th token; needs a 3rd block at 64
    "short": (30, 12, None),  # grows past its first block while the others hold the rest
    "late": (70, 6, 2),
}


def _row(rid: str, pos: int) -> torch.Tensor:
    """The 'model's' final hidden state of request ``rid`` at position ``pos``."""
    base = sum(map(ord, rid)) * 1000.0 + pos
    return base + torch.arange(HIDDEN, dtype=torch.float32) / 10


def _token(rid: str, index: int) -> int:
    """The token request ``rid`` samples as its ``index``-th output."""
    stop_at = REQUESTS[rid][2]
    return STOP if index == stop_at else 100 + (sum(map(ord, rid)) * 7 + index) % 800


def _add(scheduler, rid: str) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    prompt_len, max_tokens, _ = REQUESTS[rid]
    params = SamplingParams(
        max_tokens=max_tokens,
        stop_token_ids=[STOP],
        extra_args={"kvbridge": {"request_id": rid}},
    )
    params.update_from_generation_config({}, None)
    prompt = [200 + (i * 13 + len(rid)) % 500 for i in range(prompt_len)]
    scheduler.add_request(Request(rid, prompt, params, None))


def _execute(scheduler, out, runner, active, reached: dict[str, int], finalize: str = "post_forward"):
    """What V2's execute_model + sample_tokens do around our hook, for one step; returns
    the ModelRunnerOutput the engine core hands the scheduler (now or a step later).
    ``reached``: per request, the end of the furthest forward it ran. ``finalize``: how the
    step ends its connector work (``test_runner_v2_connector.end_step``)."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState, sort_batch_req_ids

    if out.total_num_scheduled_tokens == 0:
        output = active.no_forward(out)
        runner._kvbridge_take_step()  # our execute_model override, after vLLM's
        return output
    computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    ids = sort_batch_req_ids(out.num_scheduled_tokens, out.scheduled_spec_decode_tokens, 1)
    counts = np.array([out.num_scheduled_tokens[r] for r in ids], dtype=np.int32)
    batch = InputBatch.make_dummy(
        len(ids), int(counts.sum()), InputBuffers(len(ids), int(counts.sum()), "cpu")
    )
    starts = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    batch.req_ids = ids
    batch.num_scheduled_tokens = counts
    batch.query_start_loc_np = starts
    batch.num_computed_tokens_np = np.array([computed[r] for r in ids], dtype=np.int32)
    hidden = torch.stack([_row(r, computed[r] + j) for r, n in zip(ids, counts) for j in range(n)])
    runner._kvb_capture.scheduler_output = out  # our execute_model override
    active.pre_forward(out)
    active.finish_forward()
    runner.execute_model_state = ExecuteModelState(
        batch, None, None, hidden, None, None, set(), None, None, 0
    )
    runner._kvbridge_before_sampling()  # our sample_tokens override, before vLLM's
    runner.execute_model_state = None
    sampled = []
    for r, n in zip(ids, counts):
        end = int(computed[r] + n)
        reached[r] = max(reached.get(r, 0), end)
        request = scheduler.requests[r]
        # A chunk that does not reach the request's last known token samples nothing.
        sampled.append([] if request.is_prefill_chunk else [_token(r, end - request.num_prompt_tokens)])
    result = ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
    )
    result.kv_connector_output = end_step(active, out.finished_req_ids, finalize)
    runner._kvbridge_take_step()  # our sample_tokens override, after vLLM's
    return result


class _Harness:
    """vLLM's scheduler + V2's connector wrapper + our V2 runner + two payload receivers."""

    def __init__(
        self,
        model_dir: Path,
        async_scheduling: bool,
        runner_cls: type | None = None,
        finalize: str = "post_forward",
    ) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

        from vllm_kvbridge.connectors.registry import create_connector
        from vllm_kvbridge.runner.ar_runner_v2 import KVBridgeV2ARModelRunner
        from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
        from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

        self.async_scheduling = async_scheduling
        self.finalize = finalize
        self.scheduler = make_scheduler(
            model_dir,
            SETTINGS,
            num_blocks=8,  # 256 tokens for 290 prompt tokens: requests are preempted
            block_size=BLOCK,
            enable_prefix_caching=False,
            max_num_batched_tokens=64,
            scheduler_cls=AsyncScheduler if async_scheduling else None,
        )
        config, kv_cache_config = self.scheduler.vllm_config, self.scheduler.kv_cache_config
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        cache = torch.zeros(8, spec.num_kv_heads, BLOCK, 2 * spec.head_size)
        self.worker = KVBridgeConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.conns = [
            create_connector("SharedMemoryConnector", {"namespace": ns}) for ns in (NS_FULL, NS_CHUNK)
        ]
        self.full = PayloadReceiver(self.conns[0], 0, 1, mode="full", recv_timeout_s=30)
        self.chunks = PayloadReceiver(
            self.conns[1], 0, 2, mode="async_chunk", recv_timeout_s=30, stall_timeout_s=30
        )
        # V2's own __init__ needs CUDA: the object gets what our hooks read.
        self.runner = object.__new__(runner_cls or KVBridgeV2ARModelRunner)
        self.runner.vllm_config = config
        self.runner._kvbridge_setup_from_vllm()
        self.active = ActiveKVConnector(config, {LAYER: cache})
        self.runner._kvb_connector = self.worker.connector_worker  # initialize_kv_cache's
        self.runner.kvbridge_runtime.use_kv_sender_of(self.worker.connector_worker)
        self.runner.kvbridge_payloads.connect()
        self.preempted = 0
        self.reached: dict[str, int] = {}

    def run(self) -> None:
        """Every request, to its end. The engine core's batch queue: with async scheduling
        step k + 1 is scheduled (and runs) before step k's output reaches the scheduler."""
        for rid in REQUESTS:
            self.full.expect(rid)
            self.chunks.expect(rid)
            _add(self.scheduler, rid)
        scheduler = self.scheduler
        depth = 2 if self.async_scheduling else 1
        queue: deque = deque()
        for _ in range(400):
            if not (scheduler.has_requests() or queue):
                break
            if scheduler.has_requests() and len(queue) < depth:
                out = scheduler.schedule()
                self.preempted += len(out.preempted_req_ids or ())
                result = _execute(scheduler, out, self.runner, self.active, self.reached, self.finalize)
                queue.append((out, result))
                if len(queue) < depth and scheduler.has_requests():
                    continue
            done_out, result = queue.popleft()
            scheduler.update_from_output(done_out, result)
        assert not scheduler.has_requests() and not queue

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        kv_transfer_state._KV_CONNECTOR_AGENT = None
        self.runner.kvbridge_shutdown()
        self.full.close()
        self.chunks.close()
        for c in self.conns:
            c.close()
        self.worker.shutdown()


def _expected(rid: str) -> tuple[list[int], torch.Tensor]:
    """Request ``rid``'s generated tokens and its rows (positions 0 .. prompt + generated - 2)."""
    prompt_len, max_tokens, stop_at = REQUESTS[rid]
    generated = [_token(rid, i) for i in range(max_tokens if stop_at is None else stop_at + 1)]
    return generated, torch.stack([_row(rid, p) for p in range(prompt_len + len(generated) - 1)])


@pytest.mark.parametrize("finalize", FINALIZE)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_v2_capture_pairs_rows_with_the_schedulers_tokens(
    tiny_model_dir: Path, async_scheduling: bool, finalize: str
) -> None:
    h = _Harness(tiny_model_dir, async_scheduling, finalize=finalize)
    try:
        h.run()
        assert h.preempted > 0  # rows were recomputed after a preemption
        # Async: the request that sampled STOP ran one forward more (the row of its last
        # token, never part of it); synchronous scheduling never runs that forward.
        prompt_len, _, stop_at = REQUESTS["stops"]
        assert h.reached["stops"] == prompt_len + stop_at + (1 if async_scheduling else 0)
        for rid in REQUESTS:
            generated, expected_rows = _expected(rid)
            payload = h.full.result(rid, timeout=30)
            assert payload["token_ids"].tolist() == generated, rid
            assert torch.equal(payload["hidden_states"], expected_rows), rid
            parts = list(h.chunks.iter_chunks(rid, timeout=30))
            assert torch.equal(torch.cat([p["hidden_states"] for p in parts]), expected_rows), rid
            assert torch.cat([p["token_ids"] for p in parts]).tolist() == generated, rid
            assert all(p["token_ids"].numel() >= CHUNK for p in parts[:-1]), rid
        status = h.runner.kvbridge_transfer_status(list(REQUESTS))
        assert {s["payload"] for s in status.values()} == {"done"}, status
        assert h.runner.kvbridge_debug_state()["capturing"] == []
    finally:
        h.close()
    assert shm_entries(NS_FULL) == [] and shm_entries(NS_CHUNK) == []


@pytest.mark.parametrize("finalize", FINALIZE)
def test_a_capture_that_cannot_complete_fails_its_request_alone(tiny_model_dir: Path, finalize: str) -> None:
    """A subclass hook that raises for one request, scheduler tokens that never reach the
    runner for two others (a middle update, the last one), and a last row that never comes
    out of the forward for the fourth: each fails its own payload with its own reason
    (receivers abort at once, never a short payload). Async scheduling."""
    from vllm_kvbridge.runner.ar_runner_v2 import KVBridgeV2ARModelRunner
    from vllm_kvbridge.runner.payload_stream import PayloadAborted

    class Faulty(KVBridgeV2ARModelRunner):
        def kvbridge_step_extras(self, req_id, hidden):
            if req_id == "short":
                raise ValueError("no extras for you")
            return {}

        def kvbridge_connector_step(self, finished, capture=None):
            # Lost on the way: the update with "late"'s 2nd token, and "stops"'s last one.
            lost = {"late": lambda u: u.start == 1, "stops": lambda u: "stops" in finished}
            capture = {k: u for k, u in (capture or {}).items() if not (k in lost and lost[k](u))}
            super().kvbridge_connector_step(finished, capture)

        def _kvbridge_capture_rows(self, hidden, batch):
            # "long"'s last row (position 150 + 9 - 2) never comes out of the forward.
            super()._kvbridge_capture_rows(hidden, [b for b in batch if b[0] != "long" or b[3] != 157])

    h = _Harness(tiny_model_dir, True, Faulty, finalize)
    try:
        h.run()
        for rid, why in (
            ("short", "kvbridge_step_extras: ValueError: no extras for you"),
            ("late", "the scheduler's tokens 1..1 of this request never arrived"),
            ("stops", "the scheduler's final tokens of this request never arrived"),
            ("long", "rows of positions 157..157 never arrived from the forward"),
        ):
            for receive in (
                lambda r: h.full.result(r, timeout=30),
                lambda r: list(h.chunks.iter_chunks(r, timeout=30)),
            ):
                with pytest.raises(PayloadAborted, match=why):
                    receive(rid)
            status = h.runner.kvbridge_transfer_status([rid])[rid]["payload"]
            assert status.startswith("failed") and why in status, status
        assert h.runner.kvbridge_debug_state()["capturing"] == []
    finally:
        h.close()
    assert shm_entries(NS_FULL) == [] and shm_entries(NS_CHUNK) == []


pytestmark = pytest.mark.forked
