"""Engine settings under which a stage's KV or captured rows would be wrong are refused
before anything moves (issue 35, item 6): pipeline parallelism, decode/prefill context
parallelism, speculative decoding on capture stages and drafters with KV of their own on KV
stages. Once when the config is resolved (``engine_args``), and again when vLLM builds the
connector (a stock ``vllm serve`` never passes through our resolver).

Real ``VllmConfig`` objects from vLLM's own ``EngineArgs`` on the tiny model (no engine is
started) and the real connector constructor.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from runner_fixtures import kv_sender_settings

from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.config.engine_support import EngineFeatures, check_engine_supported
from vllm_kvbridge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
CAPTURE = {"stage_id": 0, "payload": {"capture_hidden_states": True, "outputs": [{"to_stage": 1}]}}


def _config(model_dir: Path, settings: dict | None = None, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvbridge.runner.worker import engine_kwargs

    stage = engine_kwargs(settings, platform="cpu") if settings is not None else {}
    stage.pop("worker_cls", None)
    stage.pop("worker_extension_cls", None)
    args = EngineArgs(
        model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=512, **stage, **kwargs
    )
    return args.create_engine_config()


def test_capture_refuses_speculative_decoding(tiny_model_dir: Path) -> None:
    # Issue 11, case 14: draft rows that the verifier rejects would end up in the payload.
    features = EngineFeatures.from_vllm_config(_config(tiny_model_dir, speculative_config=NGRAM))
    with pytest.raises(ConfigError, match=r"speculative decoding.*ngram"):
        check_engine_supported(features, sends_kv=False, captures=True, where="engine")
    # KV carries no draft rows with ngram (no drafter layers): a KV stage may use it.
    check_engine_supported(features, sends_kv=True, captures=False, where="engine")
    plain = EngineFeatures.from_vllm_config(_config(tiny_model_dir))
    check_engine_supported(plain, sends_kv=True, captures=True, where="engine")


def test_the_connector_refuses_such_an_engine_at_start(tiny_model_dir: Path) -> None:
    """What vLLM builds for a stock ``vllm serve --kv-transfer-config``: the connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

    config = _config(tiny_model_dir, CAPTURE, speculative_config=NGRAM)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r"engine\.speculative_config: .*capture"):
            KVBridgeConnector(config, role)


def test_the_features_of_a_real_engine_config(tiny_model_dir: Path) -> None:
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(pipeline_parallel_size=2, decode_context_parallel_size=1)
    features = EngineFeatures.from_vllm_config(type("C", (), {"parallel_config": parallel})())
    assert features.pipeline_parallel_size == 2 and features.speculative_method is None
    with pytest.raises(ConfigError, match=r"engine\.pipeline_parallel_size: 2 .*sends KV"):
        check_engine_supported(features, sends_kv=True, captures=False, where="engine")
    check_engine_supported(features, sends_kv=False, captures=False, where="engine")  # moves nothing


def test_a_fed_stage_refuses_microbatching_from_a_real_parallel_config() -> None:
    """The model runs once per microbatch, the feed's rows cover the whole step."""
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(ubatch_size=2)
    features = EngineFeatures.from_vllm_config(type("C", (), {"parallel_config": parallel})())
    assert features.microbatches == 2
    with pytest.raises(ConfigError, match=r"engine\.enable_dbo/ubatch_size: microbatching \(2 "):
        check_engine_supported(features, sends_kv=False, captures=False, where="engine", fed=True)
    check_engine_supported(features, sends_kv=True, captures=True, where="engine")  # not fed: fine


@pytest.mark.parametrize(
    ("config", "stage", "args", "match"),
    [
        ("ar_to_dit_shm.yaml", 0, {"pipeline_parallel_size": 2}, r"pipeline_parallel_size: 2 .*sends KV"),
        ("ar_to_dit_shm.yaml", 0, {"decode_context_parallel_size": 2}, r"decode_context_parallel_size"),
        ("ar_to_dit_shm.yaml", 0, {"prefill_context_parallel_size": 2}, r"prefill_context_parallel_size"),
        (
            "ar_to_dit_shm.yaml",
            0,
            {"speculative_config": {"method": "eagle", "model": "x", "num_speculative_tokens": 2}},
            r"'eagle' keeps KV of its drafter",
        ),
        (
            "ar_to_dit_shm.yaml",
            0,
            {"speculative_config": {"model": "draft", "num_speculative_tokens": 2}},
            r"'draft_model' keeps KV",
        ),
        ("thinker_talker_full_payload.yaml", 0, {"speculative_config": NGRAM}, r"capture .*speculative"),
        ("thinker_talker_full_payload.yaml", 0, {"pipeline_parallel_size": 2}, r"captures hidden states"),
        ("thinker_talker_async_chunk.yaml", 1, {"enable_dbo": True}, r"microbatching \(2 .*fed per step"),
        ("thinker_talker_vocoder.yaml", 1, {"ubatch_size": 3}, r"microbatching \(3 .*fed per step"),
    ],
)
def test_the_resolver_refuses_them_naming_the_key(config: str, stage: int, args: dict, match: str) -> None:
    data = yaml.safe_load((ROOT / "stage_configs" / config).read_text())
    data["stages"][stage]["engine_args"] = args
    with pytest.raises(ConfigError, match=rf"^stages\[{stage}\]\.engine_args\..*{match}"):
        resolve_spec(spec_from_dict(copy.deepcopy(data), env={}), platform="cuda")


def test_what_stays_allowed() -> None:
    kv = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text())
    kv["stages"][0]["engine_args"] = {"speculative_config": NGRAM}  # no drafter KV
    resolve_spec(spec_from_dict(copy.deepcopy(kv), env={}), platform="cuda")
    talk = yaml.safe_load((ROOT / "stage_configs/thinker_talker_full_payload.yaml").read_text())
    talk["stages"][1]["engine_args"] = {"pipeline_parallel_size": 2}  # the talker sends nothing
    resolve_spec(spec_from_dict(copy.deepcopy(talk), env={}), platform="cuda")
    talk["stages"][1]["engine_args"] = {"enable_dbo": True}  # fed its prompt embeddings, not per step
    resolve_spec(spec_from_dict(copy.deepcopy(talk), env={}), platform="cuda")


def test_kv_sender_settings_helper_still_builds_a_kv_stage(tiny_model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

    config = _config(tiny_model_dir, kv_sender_settings("engsup"), speculative_config=NGRAM)
    connector = KVBridgeConnector(config, KVConnectorRole.SCHEDULER)  # ngram on a KV stage: fine
    connector.shutdown()
