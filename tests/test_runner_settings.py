"""RunnerSettings parsing, request-id resolution and the start-up checks (no engine)."""

from __future__ import annotations

import pytest

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.settings import RunnerSettings

GOOD = {
    "stage_id": 0,
    "kv_transfer": {"need_send_cache": True, "to_stage": 1},
    "kv_send": {"trigger": "prefill_finished", "stop_after_transfer": True},
    "payload": {
        "capture_hidden_states": True,
        "replace_keys": ["meta"],
        "custom_process_next_stage_input_func": "builtins.dict",
        "outputs": [{"to_stage": 1, "mode": "async_chunk", "connector": "zmq", "chunk_size": 8}],
        "inputs": [{"from_stage": 2, "mode": "full", "recv_timeout_s": 5}],
    },
}


def test_full_settings_parse() -> None:
    s = RunnerSettings.from_dict(GOOD)
    assert s.sends_kv and not s.receives_kv and s.needs_connector
    assert s.kv_send.trigger == "prefill_finished" and s.kv_send.stop_after_transfer
    out = s.payload.outputs[0]
    assert (out.peer_stage, out.mode, out.connector, out.chunk_size) == (1, "async_chunk", "zmq", 8)
    assert s.payload.inputs[0].recv_timeout_s == 5.0
    assert s.payload.process_func() is dict
    assert s.kv_transfer_config().stage_id == 0
    assert not RunnerSettings.from_dict(None).needs_connector


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"stage": 1}, r"kvbridge\.stage: unknown key"),
        ({"kv_send": {"trigger": "later"}}, r"kvbridge\.kv_send\.trigger: must be one of"),
        ({"kv_send": {"trigger": "special_token"}}, r"trigger_token_id: required"),
        ({"kv_send": {"trigger_token_id": 3}}, r"only valid with trigger 'special_token'"),
        ({"kv_send": {"stop_after_transfer": True}}, r"stop_after_transfer: only valid"),
        ({"kv_transfer": {"need_send_cache": True}}, r"to_stage: required"),
        ({"kv_transfer": {"recv_timeot": 1}}, r"kvbridge\.kv_transfer\.recv_timeot: unknown key"),
        (
            {"payload": {"outputs": [{"to_stage": 1, "chunk_sise": 3}]}},
            r"kvbridge\.payload\.outputs\[0\]\.chunk_sise: unknown key",
        ),
        ({"payload": {"outputs": [{"to_stage": 1, "chunk_size": 0}]}}, r"chunk_size: must be > 0"),
        ({"payload": {"outputs": [{"to_stage": 1, "mode": "none"}]}}, r"mode: must be one of"),
        ({"payload": {"outputs": [{"mode": "full"}]}}, r"outputs\[0\]\.to_stage: required"),
        ({"payload": {"inputs": [{"from_stage": 0, "stall_timeout_s": True}]}}, r"stall_timeout_s: expected"),
        ({"payload": {"outputs": [{"to_stage": 1}, {"to_stage": 1}]}}, r"one edge per peer stage"),
        ({"payload": {"custom_process_next_stage_input_func": "not a path"}}, r"not a dotted path"),
        ({"stage_id": "bad id!"}, r"stage_id: must match"),
    ],
)
def test_bad_settings_name_the_key(patch: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunnerSettings.from_dict(patch)


def test_process_func_that_does_not_import_is_a_config_error() -> None:
    s = RunnerSettings.from_dict({"payload": {"custom_process_next_stage_input_func": "nope_pkg.mod.fn"}})
    with pytest.raises(ConfigError, match=r"cannot load 'nope_pkg\.mod\.fn'"):
        s.payload.process_func()


def test_external_request_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_kvbridge.runner.vllm_connector import external_request_id, transfer_id_for

    assert external_request_id("req-7-a1b2c3d4") == "req-7"
    assert external_request_id("plain") == "plain"
    assert external_request_id("x-short") == "x-short"

    class Params:
        extra_args = {"kvbridge": {"request_id": "orchestrator-1"}}

    assert transfer_id_for("0-abcdefgh", Params()) == "orchestrator-1"
    assert transfer_id_for("0-abcdefgh", None) == "0"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert external_request_id("req-7-a1b2c3d4") == "req-7-a1b2c3d4"


def test_start_up_check_refuses_a_runner_without_the_mixin() -> None:
    from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin
    from vllm_kvbridge.runner.worker import CPU_WORKER as CPU
    from vllm_kvbridge.runner.worker import check_worker_cls, engine_kwargs, validate_runner

    settings = RunnerSettings.from_dict(GOOD)

    class PlainRunner:
        pass

    class GoodRunner(KVBridgeModelRunnerMixin):
        pass

    with pytest.raises(ConfigError, match=r"does not have .*KVBridgeModelRunnerMixin"):
        validate_runner(PlainRunner(), settings)
    validate_runner(GoodRunner(), settings)
    validate_runner(PlainRunner(), RunnerSettings.from_dict({}))  # moves nothing: fine

    with pytest.raises(ConfigError, match="is not a kvbridge worker"):
        check_worker_cls("vllm.v1.worker.cpu_worker.CPUWorker", GOOD)
    with pytest.raises(ConfigError, match=r"worker_cls: cannot load 'no_such\.module\.Worker'"):
        check_worker_cls("no_such.module.Worker", GOOD)
    check_worker_cls("vllm_kvbridge.runner.worker.KVBridgeCPUWorker", GOOD)

    kwargs = engine_kwargs(GOOD, platform="cpu")
    assert kwargs["worker_cls"] == "vllm_kvbridge.runner.worker.KVBridgeCPUWorker"  # payloads: hooks
    assert kwargs["kv_transfer_config"]["kv_connector"] == "KVBridgeConnector"
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"] == {"kvbridge": GOOD}
    # KV alone: vLLM's stock worker (plus the RPC extension); any worker_cls given is kept.
    kv_only = {"stage_id": 0, "kv_transfer": {"need_send_cache": True, "to_stage": 1}}
    kwargs = engine_kwargs(kv_only, platform="cpu")
    assert "worker_cls" not in kwargs and kwargs["worker_extension_cls"].endswith("KVBridgeWorkerExtension")
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"] == {"kvbridge": kv_only}
    check_worker_cls("vllm.v1.worker.cpu_worker.CPUWorker", kv_only)
    assert engine_kwargs(kv_only, worker_cls=CPU)["worker_cls"] == CPU
    assert "worker_extension_cls" not in engine_kwargs(kv_only, worker_cls=CPU)  # it has the RPCs
    stock = "vllm.v1.worker.cpu_worker.CPUWorker"
    assert engine_kwargs(kv_only, worker_cls=stock)["worker_extension_cls"] == kwargs["worker_extension_cls"]
    with pytest.raises(ConfigError, match="unknown key"):
        engine_kwargs({"bogus": 1}, platform="cpu")


def test_engine_env_keeps_the_plain_engines_cpu_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from vllm_kvbridge.runner.worker import RESERVED_CPU_ENV, engine_env, engine_env_vars

    monkeypatch.delenv(RESERVED_CPU_ENV, raising=False)
    assert engine_env_vars(platform="gpu") == {}
    assert engine_env_vars(platform="cpu") == {RESERVED_CPU_ENV: "1"}  # x86/Arm: one per local rank
    assert engine_env_vars(tensor_parallel_size=2, platform="cpu") == {RESERVED_CPU_ENV: "2"}
    with engine_env(platform="cpu") as env:
        assert os.environ[RESERVED_CPU_ENV] == env[RESERVED_CPU_ENV] == "1"
    assert RESERVED_CPU_ENV not in os.environ  # restored once the engine is started
    monkeypatch.setenv(RESERVED_CPU_ENV, "0")  # the user's choice wins
    assert engine_env_vars(platform="cpu") == {}
    with engine_env(platform="cpu"):
        assert os.environ[RESERVED_CPU_ENV] == "0"
    assert os.environ[RESERVED_CPU_ENV] == "0"
