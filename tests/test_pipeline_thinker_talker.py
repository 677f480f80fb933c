"""Thinker -> talker end to end (two vLLM engines), full payload and async chunk.

The talker's received embeddings must equal the thinker's final-norm hidden states (as
transformers computes them for the prompt and generated tokens), and the async-chunk run
must deliver exactly what the full-payload run delivers. Full payload runs the shipped
config (shm), async chunk the shipped config with its edge over ZMQ; the shipped async-chunk
config itself (shm) is checked the same way by test_serve_thinker_talker's server.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import msgspec
import pytest
import torch
import yaml
from pipeline_fixtures import ROOT, hf_reference, load_dump, processes_using, shm_segments

from vllm_kvbridge.connectors.keys import encode_request_id
from vllm_kvbridge.models.tiny_llama import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline

pytestmark = [pytest.mark.engine, pytest.mark.slow]
PROMPTS = ["A cute cat", "Once upon a time there was a tiny model"]


def _zmq_async_chunk_config() -> Path:
    """The shipped async-chunk config with its edge over ZMQ: the talker starts receiving
    before the thinker put any chunk, so it must learn the thinker's endpoint up front
    (issue 11, case 7: it was started with empty sender info and failed at once)."""
    config = yaml.safe_load((ROOT / "stage_configs/thinker_talker_async_chunk.yaml").read_text())
    config["connectors"] = {"zmq": {"name": "ZmqConnector"}}
    config["edges"] = [{"from_stage": 0, "to_stage": 1, "connector": "zmq"}]
    path = Path(tempfile.mkdtemp(prefix="kvb-tt-zmq-")) / "thinker_talker_async_chunk_zmq.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(config: str | Path, dump: Path) -> tuple[list, str]:
    pipe = Pipeline.from_config(
        ROOT / "stage_configs" / config, model=str(ensure_tiny_model()), log_dir=dump / "logs"
    )
    pipe.plan = msgspec.structs.replace(
        pipe.plan, stages=[msgspec.structs.replace(s, debug_dump_dir=str(dump)) for s in pipe.plan.stages]
    )
    with pipe:
        results = pipe.generate(PROMPTS)
    return results, pipe.run_id


@pytest.mark.forked
@pytest.mark.timeout(750)
def test_thinker_talker_full_payload_and_async_chunk_agree() -> None:
    model = ensure_tiny_model()
    received: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    configs = ("thinker_talker_full_payload.yaml", _zmq_async_chunk_config())
    for config in configs:
        dump = Path(tempfile.mkdtemp(prefix="kvb-tt-"))
        results, run_id = _run(config, dump)
        received[config] = {}
        for r in results:
            assert r.error is None, r.error
            thinker = r.stages[0].output
            assert isinstance(r.text, str) and len(r.token_ids) > 0  # the talker generated
            got = load_dump(dump / f"stage1_{encode_request_id(r.request_id)}_payload.safetensors")
            received[config][r.request_id] = got
            tokens = list(thinker["prompt_token_ids"]) + list(thinker["token_ids"])
            _, hidden = hf_reference(model, tokens[:-1])
            assert got["hidden_states"].shape == hidden.shape
            assert (got["hidden_states"] - hidden).abs().max().item() <= 1e-4
            assert got["token_ids"].tolist() == list(thinker["token_ids"])
            assert any(t.what == "payload" and t.nbytes > 0 for t in r.transfers)
        assert processes_using(dump) == []
        assert shm_segments(f"kvbridge.{run_id}") == []
    full, chunked_zmq = received.values()
    for rid in full:
        for key in ("hidden_states", "token_ids"):
            assert torch.equal(full[rid][key], chunked_zmq[rid][key]), (rid, key)
