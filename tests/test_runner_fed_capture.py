"""A stage fed per step that also captures and streams its own payload (issue 40, item 1).

The thinker -> talker (fed per step) -> vocoder shape, at the talker, without an engine:
vLLM's real scheduler with the kvbridge gate (:class:`KVBridgeScheduler`) and the
scheduler half of the KV connector (its :class:`ConditioningFeeds` receiving the thinker's
stream over shared memory from a real :class:`PayloadSender`, played by this test), the
worker half of the connector driven through vLLM's own V1 connector lifecycle, and the
kvbridge V1 runner hooks (``_model_forward``: conditioning in, capture out) on a runner
object whose "vLLM part" is played by this test: a persistent batch whose order changes
every step (as V1's reorders and condensing do), and a model whose hidden row at position
``p`` is the conditioning row it was given there plus ``p``.

Several requests, some added while others are mid-stream and before any of their rows
arrived, a long prompt split by chunked prefill, few KV blocks (preemption: recomputed
positions), a stream shorter than the request (zeros past its end). Requests are sent the
way the pipeline sends them to a stage that sends payloads (``skip_reading_prefix_cache``)
and as a stock client would. What must hold: every position of every forward (recomputed
ones too) was conditioned on its own request's row of that position (zeros only past the
end of a finished stream), and each request's streamed chunks are its own rows and tokens,
in order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from runner_fixtures import shm_entries, shm_namespace
from scheduler_fixtures import make_scheduler

from vllm_kvbridge.runner import conditioning_scheduler
from vllm_kvbridge.runner.ar_runner import _V1RunnerHooks

pytestmark = pytest.mark.forked

NS_IN, NS_OUT = shm_namespace("fci"), shm_namespace("fco")
DIM = 8  # the thinker's rows; the model's conditioning width and hidden size
OUT_CHUNK = 3  # tokens per talker chunk
BLOCK = 16
BOS = 1

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
    """The fed model's hook (runner/conditioning.py's contract) and nothing else."""

    kvbridge_conditioning_dim = DIM

    def __init__(self) -> None:
        self.rows: torch.Tensor | None = None

    def kvbridge_set_conditioning(self, rows: torch.Tensor) -> None:
        self.rows = rows


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


class _Harness:
    def __init__(self, model_dir: Path, skip_prefix_cache: bool) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from vllm_kvbridge.connectors.registry import create_connector
        from vllm_kvbridge.runner.payload_receiver import PayloadReceiver
        from vllm_kvbridge.runner.payload_stream import PayloadSender
        from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

        self.skip_prefix_cache = skip_prefix_cache
        self.scheduler = make_scheduler(
            model_dir,
            SETTINGS,
            num_blocks=4,  # 3 usable blocks of 16 for 128 tokens: requests are preempted
            block_size=BLOCK,
            max_num_batched_tokens=16,
            max_num_seqs=8,
            scheduler_cls=conditioning_scheduler.KVBridgeScheduler,
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
        self.runner = object.__new__(_Runner)
        self.runner.vllm_config = config
        self.runner.device = torch.device("cpu")
        self.runner.model = _Model()
        self.runner.forward = self._forward
        self.runner.input_batch = SimpleNamespace(req_ids=[])
        self.runner.requests = {}
        self.runner._kvbridge_setup_from_vllm()
        self.runner.load_model()  # our hook: checks the model's conditioning hook, sets feed_dim
        self.runner._kvb_connector = self.worker.connector_worker  # initialize_kv_cache's
        self.runner.kvbridge_runtime.use_kv_sender_of(self.worker.connector_worker)
        self.runner.kvbridge_payloads.connect()
        self.sent: dict[str, int] = {}
        #: every (request, position) a forward computed, with the row it was conditioned on
        self.seen: list[tuple[str, int, torch.Tensor]] = []
        self.preempted = 0
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
        rows = runner.model.rows
        assert rows is not None and rows.shape[0] == so.total_num_scheduled_tokens
        hidden = torch.empty(rows.shape)
        offset = 0
        for rid in runner.input_batch.req_ids:
            start = runner.requests[rid].num_computed_tokens
            for j in range(so.num_scheduled_tokens[rid]):
                self.seen.append((rid, start + j, rows[offset].clone()))
                hidden[offset] = rows[offset] + (start + j)
                offset += 1
        return hidden

    def _execute(self, out: Any) -> Any:
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
        sampled = []
        for rid in runner.input_batch.req_ids:
            req = self.scheduler.requests[rid]
            sampled.append([] if req.is_prefill_chunk else [_token(rid, len(req.output_token_ids))])
        ids = list(runner.input_batch.req_ids)
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
        for step in range(400):
            self._events(step)
            added = all(step >= r[4] for r in REQUESTS.values())
            if added and not scheduler.has_requests():
                break
            out = scheduler.schedule()
            self.preempted += len(out.preempted_req_ids or ())
            result = self._execute(out)
            scheduler.update_from_output(out, result)
            self.steps += 1
        assert not scheduler.has_requests(), "the requests did not finish in 400 steps"

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


@pytest.mark.parametrize("skip_prefix_cache", [True, False], ids=["as-the-pipeline-sends", "stock"])
def test_a_fed_stage_that_streams_its_own_payload_keeps_each_requests_rows(
    tiny_model_dir: Path, skip_prefix_cache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step where every request waits for rows sleeps on the feed; the script delivers
    # rows only between steps, so that sleep would only slow the test down.
    monkeypatch.setattr(conditioning_scheduler, "IDLE_WAIT_S", 0.001)
    h = _Harness(tiny_model_dir, skip_prefix_cache)
    try:
        h.run()
        assert h.preempted > 0  # positions were recomputed after a preemption
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
