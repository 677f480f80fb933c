"""A stage fed per step that also captures and streams its own payload (issue 40, items 1
and 3), on vLLM's V1 runner and on Model Runner V2 (the GPU default).

The thinker -> talker (fed per step) -> vocoder shape, at the talker, without an engine:
vLLM's real scheduler with the kvbridge gate (:class:`KVBridgeScheduler`, or
:class:`KVBridgeAsyncScheduler` with the engine core's batch queue) and the scheduler half
of the KV connector (its :class:`ConditioningFeeds` receiving the thinker's stream over
shared memory from a real :class:`PayloadSender`, played by this test), the worker half of
the connector driven through vLLM's own connector lifecycle, and the kvbridge runner
hooks on a runner object whose "vLLM part" is played by this test:

* V1 (``_model_forward``: conditioning in, capture out): a persistent batch whose order
  changes every step (as V1's reorders and condensing do).
* V2 (``prepare_inputs``: conditioning in; ``sample_tokens``: capture out): V2's
  ``execute_model`` / ``sample_tokens`` as vLLM 0.32 and 0.33 run them (V2's own need
  CUDA and Triton), calling the runner's real overrides in V2's order: ``prepare_inputs``
  builds a real ``InputBatch`` in ``sort_batch_req_ids`` order (not the scheduler's),
  padded to a CUDA-graph size as V2's FULL mode pads it, then vLLM's
  ``ActiveKVConnector.pre_forward``, the forward, ``finish_forward``, ``post_forward``.

The model is the tiny talker's real conditioning buffer (``ConditioningBuffer``: the
runner's rows are copied into a fixed buffer, the forward reads ``[:num_tokens after
padding]`` and zeroes it) and a hidden row at position ``p`` that is the conditioning row
it read there plus ``p``.

Several requests, some added while others are mid-stream and before any of their rows
arrived, a long prompt split by chunked prefill, few KV blocks (preemption: recomputed
positions) or enough for requests to run side by side (a prefill chunk ahead of a decode
in the scheduler's order, which V2 sorts the other way round), a stream shorter than the
request (zeros past its end). Requests are sent the
way the pipeline sends them to a stage that sends payloads (``skip_reading_prefix_cache``)
and as a stock client would. What must hold: every position of every forward (recomputed
ones too) was conditioned on its own request's row of that position (zeros only past the
end of a finished stream), padded tokens read zeros, and each request's streamed chunks
are its own rows and tokens, in order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from runner_fixtures import shm_entries, shm_namespace
from scheduler_fixtures import make_scheduler
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2

from vllm_kvbridge.models.tiny_talker import ConditioningBuffer
from vllm_kvbridge.runner import conditioning_scheduler
from vllm_kvbridge.runner.ar_runner import _V1RunnerHooks
from vllm_kvbridge.runner.ar_runner_v2 import KVBridgeV2ARModelRunner

pytestmark = pytest.mark.forked

NS_IN, NS_OUT = shm_namespace("fci"), shm_namespace("fco")
DIM = 8  # the thinker's rows; the model's conditioning width and hidden size
OUT_CHUNK = 3  # tokens per talker chunk
BLOCK = 16
BOS = 1
TOKEN_BUDGET = 16  # max_num_batched_tokens
#: V2's FULL CUDA-graph mode pads a step's tokens up to a captured size; these are ours
#: (vLLM's own list starts 1, 2, 4, 8: fewer here, so that most steps of this test pad).
GRAPH_SIZES = (4, 8, 16)
LAYER = "model.layers.0.self_attn.attn"

SETTINGS = {
    "stage_id": 1,
    "payload": {
        "capture_hidden_states": True,
        "inputs": [
            {
                "from_stage": 0,
                "mode": "async_chunk",
                "feed": "per_step",
                "connector": "SharedMemoryConnector",
                "connector_config": {"namespace": NS_IN},
                "recv_timeout_s": 60.0,
                "stall_timeout_s": 60.0,
            }
        ],
        "outputs": [
            {
                "to_stage": 2,
                "mode": "async_chunk",
                "chunk_size": OUT_CHUNK,
                "connector": "SharedMemoryConnector",
                "connector_config": {"namespace": NS_OUT},
            }
        ],
    },
}

#: request -> (prompt length, max tokens, rows in its stream, rows per chunk, step it is
#: added at, step of its first chunk); one more chunk every other step after the first,
#: then the end.
REQUESTS = {
    "a": (1, 30, 32, 4, 0, 0),
    "b": (1, 20, 6, 4, 2, 6),  # added mid-stream of "a", 4 steps before its first row
    "c": (40, 8, 52, 24, 4, 3),  # chunked prefill (token budget 16), rows there first
    "d": (1, 20, 24, 4, 5, 9),  # grows past a block while the others hold the rest
}


def _thinker_row(rid: str, pos: int) -> torch.Tensor:
    return sum(map(ord, rid)) * 1000.0 + pos * 10.0 + torch.arange(DIM, dtype=torch.float32) / 10


def _cond(rid: str, pos: int) -> torch.Tensor:
    """What position ``pos`` of ``rid`` must be conditioned on."""
    return _thinker_row(rid, pos) if pos < REQUESTS[rid][2] else torch.zeros(DIM)


def _token(rid: str, index: int) -> int:
    return 100 + (sum(map(ord, rid)) * 7 + index) % 800


class _Model:
    """The fed model's hook (runner/conditioning.py's contract) over the tiny talker's real
    conditioning buffer, and a forward that reads it as the tiny talker's does."""

    kvbridge_conditioning_dim = DIM

    def __init__(self) -> None:
        self.kvbridge_conditioning = ConditioningBuffer(TOKEN_BUDGET, DIM)

    def kvbridge_set_conditioning(self, rows: torch.Tensor) -> None:
        self.kvbridge_conditioning.write(rows)

    def forward(self, num_tokens: int) -> torch.Tensor:
        """The rows a forward of ``num_tokens`` tokens (padding included) is conditioned on."""
        rows = self.kvbridge_conditioning.take(num_tokens).clone()
        self.kvbridge_conditioning.clear(num_tokens)
        return rows


class _VLLMPart:
    """What vLLM's V1 runner provides to the kvbridge hooks, played by the test."""

    model: _Model
    forward: Callable[[], torch.Tensor]

    def get_model(self) -> _Model:
        return self.model

    def load_model(self) -> None:
        return None

    def _model_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.forward()


class _Runner(_V1RunnerHooks, _VLLMPart):
    """The kvbridge V1 hooks over the test's vLLM part (MRO as on ``CPUModelRunner``)."""


class _V2Part(GPUModelRunnerV2):
    """Model Runner V2's ``execute_model`` / ``prepare_inputs`` / ``sample_tokens`` around the
    kvbridge hooks, as vLLM 0.32 and 0.33 (``vllm/v1/worker/gpu/model_runner.py``) run them,
    on CPU. Below the kvbridge runner in the MRO, where V2's own methods are."""

    harness: _Harness
    kv_connector: Any  # vLLM's ActiveKVConnector
    #: what V2's initialize_kv_cache builds for engine features this test turns on (a
    #: ``pcp_manager`` for prefill context parallelism, an ``adaptive_verification`` manager)
    on_device: dict[str, Any] = {}

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        return None

    def initialize_kv_cache(self, kv_cache_config: Any, is_profiling: bool = False) -> None:
        from vllm.v1.worker.gpu.kv_connector import get_kv_connector

        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        cache = torch.zeros(kv_cache_config.num_blocks, spec.num_kv_heads, BLOCK, 2 * spec.head_size)
        self.kv_connector = get_kv_connector(self.vllm_config, {LAYER: cache})  # ActiveKVConnector
        self.pcp_manager = self.on_device.get("pcp_manager")
        self.adaptive_verification = self.on_device.get("adaptive_verification")

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.v1.worker.gpu.model_runner import ExecuteModelState, sort_batch_req_ids

        so = scheduler_output
        if so.total_num_scheduled_tokens == 0:
            return self.kv_connector.no_forward(so)
        # gather_batch_req_state: V2's batch order, then the batch descriptor's padding.
        ids = sort_batch_req_ids(so.num_scheduled_tokens, so.scheduled_spec_decode_tokens, 1)
        counts = np.array([so.num_scheduled_tokens[r] for r in ids], dtype=np.int32)
        self.harness.reordered += ids != list(so.num_scheduled_tokens)
        batch_req_state = SimpleNamespace(
            req_ids=ids, num_scheduled_tokens=counts, num_tokens=int(counts.sum())
        )
        padded = next(n for n in GRAPH_SIZES if n >= batch_req_state.num_tokens)
        batch_desc = SimpleNamespace(num_tokens=padded, num_reqs=None)
        input_batch = self.prepare_inputs(so, batch_req_state, batch_desc, 0)
        self.kv_connector.pre_forward(so, input_batch)
        hidden = self.harness.forward_v2(input_batch)
        self.kv_connector.finish_forward()
        self.execute_model_state = ExecuteModelState(
            input_batch, None, None, hidden, None, None, so.finished_req_ids, None, None, 0
        )
        return None

    def prepare_inputs(
        self, scheduler_output: Any, batch_req_state: Any, batch_desc: Any, num_active_loras: int
    ):
        """V2's ``InputBatch`` of the step (what the forward's token layout is made of)."""
        from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

        so, num_tokens = scheduler_output, batch_req_state.num_tokens
        ids, counts = batch_req_state.req_ids, batch_req_state.num_scheduled_tokens
        padded = max(num_tokens, batch_desc.num_tokens)
        batch = InputBatch.make_dummy(len(ids), padded, InputBuffers(len(ids), padded, "cpu"))
        starts = np.zeros(len(ids) + 1, dtype=np.int32)
        np.cumsum(counts, out=starts[1:])
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
        batch.req_ids, batch.num_reqs, batch.num_scheduled_tokens = ids, len(ids), counts
        batch.num_tokens, batch.num_tokens_after_padding = num_tokens, padded
        batch.query_start_loc_np = starts
        batch.num_computed_tokens_np = np.array([computed[r] for r in ids], dtype=np.int32)
        return batch

    def sample_tokens(self, grammar_output: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        state, self.execute_model_state = self.execute_model_state, None
        if state is None:
            return None
        batch = state.input_batch
        sampled = [
            self.harness.sample(r, int(batch.num_computed_tokens_np[i] + batch.num_scheduled_tokens[i]))
            for i, r in enumerate(batch.req_ids)
        ]
        ids = list(batch.req_ids)
        result = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        result.kv_connector_output = self.kv_connector.post_forward(state.finished_req_ids)
        return result


class _RunnerV2(KVBridgeV2ARModelRunner, _V2Part):
    """The kvbridge V2 runner over the test's V2 part (its overrides run first, as on V2)."""


class _Harness:
    """``runner``: ``"v1"`` or ``"v2"``; ``async_scheduling``: the engine core's batch queue
    (step k + 1 is scheduled and runs before step k's output reaches the scheduler)."""

    def __init__(
        self, model_dir: Path, skip_prefix_cache: bool, runner: str, async_scheduling: bool, num_blocks: int
    ) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from vllm_kvbridge.connectors.registry import create_connector
        from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
        from vllm_kvbridge.runner.payload_stream import PayloadSender
        from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

        self.skip_prefix_cache = skip_prefix_cache
        self.async_scheduling = async_scheduling
        self.scheduler = make_scheduler(
            model_dir,
            SETTINGS,
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_num_batched_tokens=TOKEN_BUDGET,
            max_num_seqs=8,
            scheduler_cls=(
                conditioning_scheduler.KVBridgeAsyncScheduler
                if async_scheduling
                else conditioning_scheduler.KVBridgeScheduler
            ),
        )
        config = self.scheduler.vllm_config
        self.feeds = self.scheduler.connector.connector_scheduler._feeds
        self.worker = KVBridgeConnector(config, KVConnectorRole.WORKER, self.scheduler.kv_cache_config)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
        self.conn_in = create_connector("SharedMemoryConnector", {"namespace": NS_IN})
        self.conn_out = create_connector("SharedMemoryConnector", {"namespace": NS_OUT})
        self.thinker = PayloadSender(self.conn_in, 0, 1)
        self.vocoder = PayloadReceiver(
            self.conn_out, 1, 2, mode="async_chunk", recv_timeout_s=60, stall_timeout_s=60
        )
        # vLLM's runner __init__ builds a model and a device: the object gets what our hooks read.
        self.runner = object.__new__(_Runner if runner == "v1" else _RunnerV2)
        self.runner.vllm_config = config
        self.runner.device = torch.device("cpu")
        self.runner.model = _Model()
        if runner == "v1":
            self.runner.forward = self._forward
            self.runner.input_batch = SimpleNamespace(req_ids=[])
            self.runner.requests = {}
        else:
            self.runner.harness = self
        self.runner._kvbridge_setup_from_vllm()
        self.runner.load_model()  # our hook: checks the model's conditioning hook, sets feed_dim
        if runner == "v1":
            self.runner._kvb_connector = self.worker.connector_worker  # initialize_kv_cache's
            self.runner.kvbridge_runtime.use_kv_sender_of(self.worker.connector_worker)
            self.runner.kvbridge_payloads.connect()
        else:
            self.runner.initialize_kv_cache(self.scheduler.kv_cache_config)  # ours, then V2's
        self.sent: dict[str, int] = {}
        #: every (request, position) a forward computed, with the row it was conditioned on
        self.seen: list[tuple[str, int, torch.Tensor]] = []
        self.preempted = 0
        self.padded = 0  # padded tokens V2's forwards ran
        self.reordered = 0  # V2 steps whose batch order is not the scheduler's
        self.steps = 0

    # -- the thinker ---------------------------------------------------------------------------
    def _deliver(self, rid: str) -> None:
        """The thinker's next chunk of ``rid`` (or its end), waited for until the talker's feed
        holds it, so that every step sees exactly the rows the script says."""
        _, _, total, chunk, *_ = REQUESTS[rid]
        have = self.sent.get(rid, 0)
        if have >= total:
            self.thinker.send_chunk(rid, None, final=True)
            self.sent[rid] = total + 1
            self._wait(lambda: self.feeds.ready(rid, 0, 10**6), f"the end of {rid}'s stream")
            return
        upto = min(total, have + chunk)
        rows = torch.stack([_thinker_row(rid, p) for p in range(have, upto)])
        self.thinker.send_chunk(rid, {"hidden_states": rows}, final=False)
        self.sent[rid] = upto
        self._wait(lambda: self.feeds.ready(rid, 0, upto), f"{rid}'s rows up to {upto}")

    @staticmethod
    def _wait(cond: Callable[[], bool], what: str) -> None:
        end = time.monotonic() + 30
        while not cond():
            assert time.monotonic() < end, f"{what} never reached the feed"
            time.sleep(0.002)

    def _add(self, rid: str) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        prompt_len, max_tokens, *_ = REQUESTS[rid]
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kvbridge": {"request_id": rid, "condition": {"from_stage": 0, "transfer_id": rid}}},
            # What the pipeline asks of a stage that sends payloads (pipeline/llm_engine.py).
            skip_reading_prefix_cache=True if self.skip_prefix_cache else None,
        )
        params.update_from_generation_config({}, None)
        prompt = [BOS] + [200 + (i * 13 + len(rid)) % 500 for i in range(prompt_len - 1)]
        self.vocoder.expect(rid)
        self.scheduler.add_request(Request(rid, prompt, params, None))

    def _events(self, step: int) -> None:
        for rid, (_, _, total, _, add_at, first_at) in REQUESTS.items():
            if step == add_at:
                self._add(rid)
            if step >= first_at and (step - first_at) % 2 == 0 and self.sent.get(rid, 0) <= total:
                self._deliver(rid)

    # -- vLLM's part of the runner -------------------------------------------------------------
    def _forward(self) -> torch.Tensor:
        """The model: at each scheduled token (in the persistent batch's order), the
        conditioning row it was given there plus the token's position."""
        runner = self.runner
        so = runner._kvb_capture.scheduler_output
        rows = runner.model.forward(so.total_num_scheduled_tokens)
        hidden = torch.empty(rows.shape)
        offset = 0
        for rid in runner.input_batch.req_ids:
            start = runner.requests[rid].num_computed_tokens
            for j in range(so.num_scheduled_tokens[rid]):
                self.seen.append((rid, start + j, rows[offset].clone()))
                hidden[offset] = rows[offset] + (start + j)
                offset += 1
        return hidden

    def forward_v2(self, input_batch: Any) -> torch.Tensor:
        """The model on V2: a forward of ``num_tokens_after_padding`` tokens laid out by
        ``input_batch`` (request ``i`` from ``query_start_loc_np[i]``); padded tokens must
        read zeros."""
        rows = self.runner.model.forward(input_batch.num_tokens_after_padding)
        hidden = rows.clone()
        starts = input_batch.query_start_loc_np
        for i, rid in enumerate(input_batch.req_ids[: input_batch.num_reqs]):
            first = int(input_batch.num_computed_tokens_np[i])
            for j in range(int(input_batch.num_scheduled_tokens[i])):
                row = rows[int(starts[i]) + j]
                self.seen.append((rid, first + j, row.clone()))
                hidden[int(starts[i]) + j] = row + (first + j)
        padding = rows[input_batch.num_tokens :]
        self.padded += padding.shape[0]
        assert not padding.any(), "a padded token read a row"
        return hidden

    def sample(self, rid: str, end: int) -> list[int]:
        """What request ``rid`` samples at the end of a forward that reached position ``end``
        (nothing from a chunk short of its last known token)."""
        request = self.scheduler.requests[rid]
        return [] if request.is_prefill_chunk else [_token(rid, end - request.num_prompt_tokens)]

    def _execute(self, out: Any) -> Any:
        """One step: V2's execute_model and sample_tokens, as the engine core calls them (the
        runner's overrides first, then the test's V2 part), or V1's, played here."""
        if isinstance(self.runner, _RunnerV2):
            result = self.runner.execute_model(out)
            return result if result is not None else self.runner.sample_tokens(None)
        return self._execute_v1(out)

    def _execute_v1(self, out: Any) -> Any:
        """What V1's ``execute_model`` does around our hooks, for one step."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        runner = self.runner
        runner._kvb_capture.scheduler_output = out  # our execute_model override
        runner._kvb_capture.steps += 1
        config = self.scheduler.vllm_config
        if out.total_num_scheduled_tokens == 0:
            result = KVConnectorModelRunnerMixin.kv_connector_no_forward(out, config)
            runner._kvbridge_take_step()
            return result
        # _update_states: the worker's request states and its persistent batch, reordered.
        for req in out.scheduled_new_reqs:
            runner.requests[req.req_id] = SimpleNamespace(num_computed_tokens=req.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
            runner.requests[rid].num_computed_tokens = n
        for rid in out.finished_req_ids:
            runner.requests.pop(rid, None)
        ids = sorted(out.num_scheduled_tokens)
        shift = self.steps % len(ids)
        runner.input_batch.req_ids = ids[shift:] + ids[:shift]
        with (
            set_forward_context(None, config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output,
        ):
            runner._model_forward()
        ids = list(runner.input_batch.req_ids)
        sampled = [
            self.sample(r, runner.requests[r].num_computed_tokens + out.num_scheduled_tokens[r]) for r in ids
        ]
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )
        runner._kvbridge_take_step()  # our execute_model override, after vLLM's
        return result

    def run(self) -> None:
        scheduler = self.scheduler
        depth = 2 if self.async_scheduling else 1
        queue: deque = deque()
        for step in range(400):
            self._events(step)
            added = all(step >= r[4] for r in REQUESTS.values())
            if added and not scheduler.has_requests() and not queue:
                break
            if len(queue) < depth and (scheduler.has_requests() or not queue):
                out = scheduler.schedule()
                self.preempted += len(out.preempted_req_ids or ())
                queue.append((out, self._execute(out)))
                self.steps += 1
                if len(queue) < depth:
                    continue
            out, result = queue.popleft()
            scheduler.update_from_output(out, result)
        assert not scheduler.has_requests() and not queue, "the requests did not finish in 400 steps"

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        kv_transfer_state._KV_CONNECTOR_AGENT = None
        self.runner.kvbridge_shutdown()
        self.thinker.close()
        self.vocoder.close()
        self.scheduler.connector.shutdown()
        self.worker.shutdown()
        self.conn_in.close()
        self.conn_out.close()


#: (runner, skip_reading_prefix_cache as the pipeline sends, async scheduling, KV blocks)
#: 4 blocks (3 usable, 48 tokens for 128): requests are preempted and recompute positions.
#: 6 blocks: requests run side by side, a prefill chunk before a decode in the scheduler's
#: order, which V2 sorts the other way round.
CASES = {
    "v1-as-the-pipeline-sends": ("v1", True, False, 4),
    "v1-stock": ("v1", False, False, 4),
    "v2-sync": ("v2", True, False, 4),
    "v2-async": ("v2", True, True, 4),  # V2 on a GPU: vLLM's defaults
    "v2-sync-side-by-side": ("v2", True, False, 6),
    "v2-async-side-by-side": ("v2", True, True, 6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_fed_stage_that_streams_its_own_payload_keeps_each_requests_rows(
    tiny_model_dir: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner, skip_prefix_cache, async_scheduling, num_blocks = CASES[case]
    # A step where every request waits for rows sleeps on the feed; the script delivers
    # rows only between steps, so that sleep would only slow the test down.
    monkeypatch.setattr(conditioning_scheduler, "IDLE_WAIT_S", 0.001)
    h = _Harness(tiny_model_dir, skip_prefix_cache, runner, async_scheduling, num_blocks)
    try:
        h.run()
        # What each case is there for: positions recomputed after a preemption; V2's padded
        # forwards (zeros checked there) and a step in V2's order, not the scheduler's.
        assert num_blocks > 4 or h.preempted > 0
        assert runner == "v1" or h.padded > 0
        assert num_blocks == 4 or h.reordered > 0
        wrong = [
            (rid, pos, row[0].item(), _cond(rid, pos)[0].item())
            for rid, pos, row in h.seen
            if not torch.equal(row, _cond(rid, pos))
        ]
        assert not wrong, f"positions conditioned on another row (request, position, got, want): {wrong}"
        for rid, (prompt_len, max_tokens, *_) in REQUESTS.items():
            parts = list(h.vocoder.iter_chunks(rid, timeout=30))
            positions = range(prompt_len + max_tokens - 1)
            expected = torch.stack([_cond(rid, p) + p for p in positions])
            assert torch.equal(torch.cat([p["hidden_states"] for p in parts]), expected), rid
            tokens = torch.cat([p["token_ids"] for p in parts]).tolist()
            assert tokens == [_token(rid, i) for i in range(max_tokens)], rid
        status = h.runner.kvbridge_transfer_status(list(REQUESTS))
        assert {s["payload"] for s in status.values()} == {"done"}, status
    finally:
        h.close()
    assert shm_entries(NS_IN) == [] and shm_entries(NS_OUT) == []


@pytest.mark.parametrize(
    ("feature", "why"),
    [
        ("pcp_manager", "prefill context parallelism"),
        ("adaptive_verification", "adaptive draft verification"),
    ],
)
def test_v2_refuses_a_fed_stage_whose_tokens_move_after_prepare_inputs(
    tiny_model_dir: Path, feature: str, why: str
) -> None:
    """The feed lays a step's rows out from V2's ``InputBatch``; two V2 features re-deal the
    tokens on the device afterwards (rows would land on other tokens): refused at start."""
    from vllm_kvbridge.errors import ConfigError

    h = _Harness(tiny_model_dir, True, "v2", False, 4)
    try:
        h.runner.on_device = {feature: object()}
        # (this stage also captures: for prefill context parallelism the capture's refusal
        # comes first, with its own reason)
        with pytest.raises(ConfigError, match=f"does not support {why}"):
            h.runner.initialize_kv_cache(h.scheduler.kv_cache_config)
    finally:
        h.close()
    assert shm_entries(NS_IN) == [] and shm_entries(NS_OUT) == []
