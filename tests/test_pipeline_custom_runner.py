"""A user's custom model runner in a real pipeline (issue 12, item 5).

``examples/custom_runner/step_logits_runner.py`` adds ``logits`` to every captured step, as
a mixin the kvbridge worker composes onto the AR runner in use; the stage config names it
(``runner_cls``). The talker
receives the payload; its dump must hold, besides the hidden states, logits that equal
transformers' next-token logits at every captured position, and whose argmax at the
positions the thinker sampled from is what it sampled (greedy).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from pipeline_fixtures import ROOT, load_dump, processes_using, shm_segments

from vllm_kvbridge.connectors.keys import encode_request_id
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline

EXAMPLE_DIR = ROOT / "examples" / "custom_runner"
#: The mixin form: the worker composes it onto the runner in use (a subclass works too).
RUNNER = "step_logits_runner.StepLogits"


def _hf_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.forked
@pytest.mark.long(500, "a pipeline of two vLLM engines (thinker, talker) with a custom runner")
def test_custom_runner_payload_output_arrives_exact(tmp_path: Path) -> None:
    model = ensure_tiny_model()
    dump = tmp_path
    config = yaml.safe_load((ROOT / "stage_configs/thinker_talker_full_payload.yaml").read_text())
    config["stages"][0]["runner_cls"] = RUNNER
    config["runtime"] = {"debug_dump_dir": str(dump)}
    path = dump / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLE_DIR), os.environ.get("PYTHONPATH")]))}
    pipe = Pipeline.from_config(path, model=str(model), env=env, log_dir=dump / "logs")
    with pipe:
        results = pipe.generate(["A cute cat", "Once upon a time"])
        run_id = pipe.run_id
    for r in results:
        assert r.error is None, r.error
        thinker = r.stages[0].output
        prompt, generated = list(thinker["prompt_token_ids"]), list(thinker["token_ids"])
        got = load_dump(dump / f"stage1_{encode_request_id(r.request_id)}_payload.safetensors")
        positions = prompt + generated[:-1]  # the last sampled token is never fed back
        ref = _hf_logits(model, positions)
        assert got["logits"].shape == ref.shape, (got["logits"].shape, ref.shape)
        assert (got["logits"] - ref).abs().max().item() <= 1e-3
        # Greedy: the thinker sampled the argmax of the logits at each position it sampled from.
        assert got["logits"][len(prompt) - 1 :].argmax(dim=-1).tolist() == generated
        assert got["hidden_states"].shape[0] == len(positions)
        assert got["token_ids"].tolist() == generated
    assert processes_using(dump) == []
    assert shm_segments(f"kvbridge.{run_id}") == []


def test_a_runner_cls_that_does_not_subclass_the_runner_in_use_is_refused() -> None:
    from vllm_kvbridge.runner.worker import KVBridgeCPUWorker

    worker = KVBridgeCPUWorker.__new__(KVBridgeCPUWorker)  # no engine: only the runner choice
    worker.device = torch.device("cpu")
    for name, why in (
        ("step_logits_runner.GPUStepLogitsRunner", "must subclass .*KVBridgeCPUModelRunner"),
        ("builtins.dict", "must subclass .* or be a mixin that overrides kvbridge hooks"),
        ("no_such_module.Runner", "cannot load"),
    ):
        settings = {"stage_id": 0, "runner_cls": name}
        worker.vllm_config = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"kvbridge": settings}),
            additional_config=None,
        )
        with pytest.raises(ConfigError, match=why):
            worker._kvbridge_make_runner()


def test_a_mixin_runner_cls_is_composed_onto_the_runner_in_use() -> None:
    """One mixin serves every runner: the worker composes it before the kvbridge runner of
    the vLLM runner in use (CPU here; V1 GPU and Model Runner V2 by the same function)."""
    from step_logits_runner import StepLogits

    from vllm_kvbridge.runner.ar_runner import KVBridgeARModelRunner, KVBridgeCPUModelRunner
    from vllm_kvbridge.runner.ar_runner_v2 import KVBridgeV2ARModelRunner
    from vllm_kvbridge.runner.worker import _compose_runner

    for base in (KVBridgeCPUModelRunner, KVBridgeARModelRunner, KVBridgeV2ARModelRunner):
        cls = _compose_runner(StepLogits, base, RUNNER)
        assert issubclass(cls, base) and cls.__mro__[1] is StepLogits
        assert cls.kvbridge_step_extras is StepLogits.kvbridge_step_extras


@pytest.fixture(autouse=True)
def _example_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE_DIR))
