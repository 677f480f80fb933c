"""Stage configs: YAML loading, ${ENV} expansion, validation errors naming the key, resolution."""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_kvbridge.config import expand_env, load_spec, resolve, resolve_spec, spec_from_dict
from vllm_kvbridge.config.runner_settings import kv_transfer_config_dict, runner_settings
from vllm_kvbridge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "stage_configs").glob("*.yaml"))

BASE = {
    "connectors": {"shm": {"name": "shm", "extra": {"ttl_s": 5}}},
    "stages": [
        {"stage_id": 0, "kind": "llm_ar", "kv_transfer": {"need_send_cache": True}},
        {"stage_id": 1, "kind": "diffusion", "kv_transfer": {"need_recv_cache": True}},
    ],
    "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
}


def _with(path: str, value, base=BASE) -> dict:
    """A copy of ``base`` with ``value`` set at a dotted path (``stages.1.kind``)."""
    data = copy.deepcopy(base)
    node = data
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    last = parts[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


def _err(data: dict) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_spec(spec_from_dict(data, env={}))
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_shipped_configs_resolve_and_have_a_header() -> None:
    assert {p.name for p in CONFIGS} >= {
        "ar_to_dit_shm.yaml",
        "ar_to_dit_zmq.yaml",
        "thinker_talker_full_payload.yaml",
        "thinker_talker_async_chunk.yaml",
        "thinker_talker_async_chunk_embeds.yaml",
        "thinker_talker_vocoder.yaml",
    }
    for path in CONFIGS:
        assert path.read_text().startswith("# "), f"{path.name} needs a comment header"
        plan = resolve(path, env={})
        assert [s.stage_id for s in plan.stages] == list(range(len(plan.stages))) and len(plan.stages) >= 2
        # every edge has a sender and a receiver end using the same connector type
        for a, b in zip(plan.stages, plan.stages[1:]):
            assert a.outputs[0].connector.name == b.inputs[0].connector.name


def test_shipped_single_rank_dit_configs_batch_and_the_default_does_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vllm_kvbridge.cli.main import main

    for path in sorted((ROOT / "stage_configs").glob("ar_to_dit_*.yaml")):
        d = resolve(path, env={}).stage(1).diffusion
        assert d["max_batch_size"] == (1 if d["num_ranks"] == 2 else 8), path.name
    assert main(["check-config", str(ROOT / "stage_configs/ar_to_dit_shm.yaml")]) == 0
    assert "batching: up to 8 requests of the same steps denoised together" in capsys.readouterr().out
    assert resolve_spec(spec_from_dict(BASE, env={})).stage(1).diffusion["max_batch_size"] == 1


def test_check_config_cli_on_every_shipped_config(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvbridge.cli.main import main

    for path in CONFIGS:
        assert main(["check-config", str(path)]) == 0
        out = capsys.readouterr().out
        assert out.rstrip().endswith("OK")
        assert "stage 0  llm_ar" in out and "-> stage 1:" in out
    assert main(["check-config", "--json", str(ROOT / "stage_configs/ar_to_dit_shm.yaml")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["stages"][0]["runner_settings"]["kv_transfer"]["to_stage"] == 1


def test_check_config_cli_broken_file_is_one_line_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = (ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text()
    bad.write_text(
        text.replace(
            "  - stage_id: 1\n    kind: diffusion\n",
            "  - stage_id: 1\n    kind: diffusion\n    input_connectors: {from_stage_0: shmm}\n",
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_kvbridge.cli.main", "check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: stages[1].input_connectors.from_stage_0: unknown connector 'shmm'")


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            "stages.1.input_connectors",
            {"from_stage_0": "shmm"},
            "stages[1].input_connectors.from_stage_0: unknown connector 'shmm'",
        ),
        ("stages.0.kv_transfer.need_send_cahce", True, "stages[0].kv_transfer.need_send_cahce: unknown key"),
        (
            "stages.0.kv_transfer.trigger",
            "later",
            "stages[0].kv_transfer.trigger: invalid enum value 'later'",
        ),
        ("stages.0.stage_id", "zero", "stages[0].stage_id: expected `int`, got `str`"),
        ("stages.1.kind", "painter", "stages[1].kind: invalid enum value 'painter'"),
        (
            "stages.0.kv_transfer.trigger",
            "special_token",
            "stages[0].kv_transfer.trigger_token_id: required when trigger is 'special_token'",
        ),
        (
            "stages.0.kv_transfer.stop_after_transfer",
            True,
            "stages[0].kv_transfer.stop_after_transfer: only valid with trigger 'prefill_finished'",
        ),
        (
            "stages.1.kv_transfer.need_recv_cache",
            False,
            "stages[1].kv_transfer.need_recv_cache: must be true because stage 0 sends KV on edge 0 -> 1",
        ),
        ("stages.1.kv_transfer.recv_timeout", 0, "stages[1].kv_transfer.recv_timeout: must be > 0"),
        ("stages.0.kv_transfer.staging_bytes", -1, "stages[0].kv_transfer.staging_bytes: must be >= 0"),
        (
            "stages.1.tensor_parallel_size",
            2,
            "stages[1].tensor_parallel_size: diffusion stages run on one rank",
        ),
        ("stages.0.tensor_parallel_size", 0, "stages[0].tensor_parallel_size: must be >= 1"),
        ("stages.1.stage_id", 0, "stages[1].stage_id: duplicate stage id 0"),
        (
            "stages.1.diffusion",
            {"class_path": "not a path"},
            "stages[1].diffusion.class_path: 'not a path' is not",
        ),
        ("stages.1.diffusion", {"num_steps": 0}, "stages[1].diffusion.num_steps: must be >= 1"),
        (
            "stages.1.diffusion",
            {"max_batch_size": 0},
            "stages[1].diffusion.max_batch_size: must be >= 1, got 0",
        ),
        (
            "stages.1.diffusion",
            {"num_ranks": 2, "max_batch_size": 4},
            "stages[1].diffusion.max_batch_size: a 2-rank (CFG-parallel) stage denoises one request "
            "at a time, got 4",
        ),
        ("stages.0.diffusion", {}, "stages[0].diffusion: only valid for kind 'diffusion'"),
        ("stages.0.engine_args", {"model": "x"}, "stages[0].engine_args.model: set it as a stage field"),
        ("stages.0.worker_cls", "nodots", "stages[0].worker_cls: 'nodots' is not a dotted path"),
        ("stages.0.runner_cls", "nodots", "stages[0].runner_cls: 'nodots' is not a dotted path"),
        ("stages.1.runner_cls", "a.B", "stages[1].runner_cls: diffusion stages run the diffusion runner"),
        ("stages.1.kv_transfer.expect", {"heads": 2}, "stages[1].kv_transfer.expect.heads: unknown key"),
        (
            "stages.1.kv_transfer.expect",
            {"head_dim": 0},
            "stages[1].kv_transfer.expect.head_dim: must be >= 1",
        ),
        (
            "stages.0.kv_transfer.expect",
            {"head_dim": 32},
            "stages[0].kv_transfer.expect: only valid on a stage that receives KV",
        ),
        ("runtime.max_in_flight", 0, "runtime.max_in_flight: must be > 0"),
        (
            "stages.0.output_connectors",
            {"to_stage_5": "shm"},
            "stages[0].output_connectors.to_stage_5: no edge 0 -> 5",
        ),
        (
            "stages.1.input_connectors",
            {"stage0": "shm"},
            "stages[1].input_connectors.stage0: keys are 'from_stage_<id>'",
        ),
        (
            "stages.0.payload",
            {"mode": "full"},
            "stages[1].payload.mode: stage 0 sends 'full' payloads on edge 0 -> 1 "
            "but this stage expects 'none'",
        ),
        ("stages.0.payload", {"chunk_size": 0}, "stages[0].payload.chunk_size: must be >= 1"),
        (
            "stages.0.payload",
            {"capture": ["logits"]},
            "stages[0].payload.capture[0]: invalid enum value 'logits'",
        ),
        (
            "connectors.shm",
            {"name": "carrier-pigeon"},
            "connectors.shm.name: unknown connector type 'carrier-pigeon'",
        ),
        ("connectors.shm", {"name": "shm", "bogus": 1}, "connectors.shm.bogus: unknown key"),
        (
            "edges",
            [{"from_stage": 0, "to_stage": 7, "connector": "shm"}],
            "edges[0].to_stage: no stage with stage_id 7",
        ),
        (
            "edges",
            [{"from_stage": 0, "to_stage": 1, "connector": "nope"}],
            "edges[0].connector: unknown connector 'nope'",
        ),
        ("runtime", {"request_timeout": -1}, "runtime.request_timeout: must be > 0"),
        ("bogus_top", 1, "bogus_top: unknown key"),
    ],
)
def test_bad_values_name_the_key(path: str, value, expected: str) -> None:
    assert _err(_with(path, value)).startswith(expected)


def test_first_stage_must_take_text_and_edges_must_carry_something() -> None:
    data = _with("stages", [{"stage_id": 0, "kind": "diffusion"}])
    assert _err(data).startswith("stages[0].kind: the first stage takes the text prompt")
    data = _with("stages.0.kv_transfer", {})
    data = _with("stages.1.kv_transfer", {}, data)
    assert _err(data).startswith("edges[0]: edge 0 -> 1 carries nothing")
    assert _err({"stages": []}).startswith("stages: at least one stage")


def test_sender_and_receiver_connector_types_must_match() -> None:
    data = _with("connectors.tcp", {"name": "zmq"})
    data = _with("stages.1.input_connectors", {"from_stage_0": "tcp"}, data)
    assert _err(data).startswith(
        "stages[1].input_connectors.from_stage_0: receiver uses ZmqConnector but "
        "stage 0 sends with SharedMemoryConnector"
    )


def test_tp_sizes_per_edge_must_divide() -> None:
    tt = {
        "connectors": {"shm": {"name": "shm"}},
        "stages": [
            {"stage_id": 0, "kind": "llm_ar", "tensor_parallel_size": 2, "payload": {"mode": "full"}},
            {"stage_id": 1, "kind": "llm_generation", "tensor_parallel_size": 3, "payload": {"mode": "full"}},
        ],
        "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
    }
    assert _err(tt).startswith("stages[1].tensor_parallel_size: TP sizes of edge 0 -> 1 must divide")
    tt["stages"][1]["tensor_parallel_size"] = 4
    plan = resolve_spec(spec_from_dict(tt, env={}))
    out, inp = plan.stage(0).outputs[0], plan.stage(1).inputs[0]
    assert (out.from_tp, out.to_tp, inp.from_tp, inp.to_tp) == (2, 4, 2, 4)
    assert plan.stage(1).engine_args["enable_prompt_embeds"] is True


def test_async_chunk_consistency_per_edge() -> None:
    tt = {
        "stages": [
            {"stage_id": 0, "kind": "llm_ar", "payload": {"mode": "async_chunk"}},
            {"stage_id": 1, "kind": "llm_generation", "payload": {"mode": "full"}},
        ],
        "edges": [{"from_stage": 0, "to_stage": 1, "connector": "shm"}],
    }
    assert _err(tt) == (
        "stages[1].payload.mode: stage 0 sends 'async_chunk' payloads on edge 0 -> 1 but this "
        "stage expects 'full'"
    )


def test_env_expansion() -> None:
    env = {"TP": "2", "HOST": "10.0.0.1", "EMPTY": ""}
    tree = {"a": "${TP}", "b": "x-${HOST}:${PORT:-5555}", "c": ["${MISSING:-dflt}", "${EMPTY}"], "d": 3}
    assert expand_env(tree, env) == {"a": 2, "b": "x-10.0.0.1:5555", "c": ["dflt", ""], "d": 3}
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.model: environment variable \$\{NOPE\} is not set"):
        expand_env({"stages": [{"model": "${NOPE}"}]}, {})
    data = _with("stages.0.tensor_parallel_size", "${TP:-1}")
    data = _with("stages.0.model", "${MODEL}", data)
    # /models/x is not on this host: the DiT's KV geometry comes from its kwargs instead
    data = _with("stages.1.diffusion", {"kwargs": {"kv_heads": 2, "kv_head_dim": 32}}, data)
    plan = resolve_spec(spec_from_dict(data, env={"TP": "1", "MODEL": "/models/x"}))
    assert plan.stage(0).model == "/models/x"


def test_yaml_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="cannot read stage config"):
        load_spec(missing)
    broken = tmp_path / "broken.yaml"
    broken.write_text("stages: [\n  - {stage_id: 0\n")
    with pytest.raises(ConfigError, match=r"invalid YAML \(line"):
        load_spec(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ConfigError, match="<root>: expected a mapping"):
        load_spec(scalar)
    # no Python tags: yaml.safe_load refuses them
    evil = tmp_path / "evil.yaml"
    evil.write_text("stages: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_spec(evil)


def test_resolved_settings_are_what_the_lower_layers_accept() -> None:
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.runner.settings import RunnerSettings

    for path in CONFIGS:
        plan = resolve(path, env={})
        for stage in plan.stages:
            if stage.is_llm:
                settings = RunnerSettings.from_dict(runner_settings(stage))
                assert settings.stage_id == stage.stage_id
            kv = kv_transfer_config_dict(stage)
            cfg = KVTransferConfig.from_dict(kv)
            assert cfg.need_send_cache == bool(stage.kv_transfer["need_send_cache"])
    plan = resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml", env={})
    send = RunnerSettings.from_dict(runner_settings(plan.stage(0)))
    assert send.sends_kv and send.kv_send.trigger == "on_finish"
    assert send.kv_transfer_config().connector == "SharedMemoryConnector"
    recv = KVTransferConfig.from_dict(kv_transfer_config_dict(plan.stage(1)))
    assert recv.need_recv_cache and recv.from_stage == 0 and recv.enable_kv_async_prefetch
    plan = resolve(ROOT / "stage_configs/thinker_talker_async_chunk.yaml", env={})
    thinker = RunnerSettings.from_dict(runner_settings(plan.stage(0)))
    talker = RunnerSettings.from_dict(runner_settings(plan.stage(1)))
    assert thinker.payload.capture_hidden_states and thinker.payload.outputs[0].mode == "async_chunk"
    assert thinker.payload.outputs[0].chunk_size == 4
    assert talker.payload.inputs[0].mode == "async_chunk" and not talker.sends_kv
    # The shipped async-chunk config overlaps the stages (the talker is fed per step); the
    # _embeds variant waits for the whole stream and makes it the prompt embeddings.
    assert talker.payload.inputs[0].feed == "per_step"
    assert plan.stage(1).model == "kvbridge://tiny-talker"
    plan = resolve(ROOT / "stage_configs/thinker_talker_async_chunk_embeds.yaml", env={})
    talker = RunnerSettings.from_dict(runner_settings(plan.stage(1)))
    assert talker.payload.inputs[0].mode == "async_chunk"
    assert talker.payload.inputs[0].feed == "prompt_embeds"


def test_model_override_and_empty_env_model(tiny_model_dir: Path) -> None:
    plan = resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml", env={})
    assert plan.stage(0).model is None
    m = str(tiny_model_dir)  # a model the DiT stage can read its KV geometry from
    assert plan.with_model(m).stage(0).model == m
    assert plan.with_model(m).stage(1).model is None  # diffusion stages take no LLM model
    plan = resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml", env={"KVBRIDGE_MODEL": "kvbridge://tiny-llama"})
    assert plan.with_model(m).stage(0).model == "kvbridge://tiny-llama"


def test_workers_per_stage_and_every_gpu_stage_keeps_vllms_runner() -> None:
    """Issue 12: a KV-only stage runs vLLM's stock worker (worker_cls None), a payload stage the
    kvbridge worker. On GPU every stage keeps vLLM's defaults (Model Runner V2, async
    scheduling): capture works on both runners, and since issue 40 a stage fed per step too
    (V2's ``prepare_inputs`` hook, tests/test_runner_fed_capture.py), so the resolver no
    longer starts it on V1; a runner its config picks itself is left as it says."""
    import yaml

    kv_only = resolve_spec(spec_from_dict(copy.deepcopy(BASE)))
    assert kv_only.stages[0].worker_cls is None
    on_gpu = functools.partial(resolve_spec, platform="cuda")
    talk = yaml.safe_load((ROOT / "stage_configs/thinker_talker_full_payload.yaml").read_text())
    thinker, talker = on_gpu(spec_from_dict(copy.deepcopy(talk))).stages
    assert thinker.worker_cls == "vllm_kvbridge.runner.worker.KVBridgeGPUWorker"
    assert "async_scheduling" not in thinker.engine_args and "VLLM_USE_V2_MODEL_RUNNER" not in thinker.env
    assert "async_scheduling" not in talker.engine_args and "VLLM_USE_V2_MODEL_RUNNER" not in talker.env
    kv_only = on_gpu(spec_from_dict(copy.deepcopy(BASE)))
    assert kv_only.stages[0].worker_cls is None and "async_scheduling" not in kv_only.stages[0].engine_args
    fed = yaml.safe_load((ROOT / "stage_configs/thinker_talker_async_chunk.yaml").read_text())
    assert fed["stages"][1]["payload"]["feed"] == "per_step"  # what this checks
    thinker, talker = on_gpu(spec_from_dict(copy.deepcopy(fed))).stages[:2]
    assert talker.worker_cls == "vllm_kvbridge.runner.worker.KVBridgeGPUWorker"
    for stage in (thinker, talker):
        assert "VLLM_USE_V2_MODEL_RUNNER" not in stage.env and "async_scheduling" not in stage.engine_args
    fed["stages"][1]["env"] = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert on_gpu(spec_from_dict(fed)).stages[1].env["VLLM_USE_V2_MODEL_RUNNER"] == "0"


def test_replicas_default_to_one_and_split_devices_among_copies() -> None:
    """Issue 41: ``replicas: N`` resolves into N copies of the stage, each with its index and
    its own share of ``devices`` (a stage without it keeps one copy, as before)."""
    plan = resolve_spec(spec_from_dict(BASE, env={}))
    assert [s.replicas for s in plan.stages] == [1, 1]
    assert plan.stages[1].for_replica(0) == plan.stages[1]
    data = _with("stages.1.replicas", 2)
    data["stages"][1]["devices"] = "0,1,2,3"
    dit = resolve_spec(spec_from_dict(data, env={})).stages[1]
    copies = [dit.for_replica(k) for k in range(2)]
    assert [(c.replica, c.devices, c.named_replica) for c in copies] == [(0, "0,1", 0), (1, "2,3", 1)]
    with pytest.raises(ValueError, match="no replica 2"):
        dit.for_replica(2)


def test_replicas_errors_name_the_key() -> None:
    assert _err(_with("stages.1.replicas", 0)) == "stages[1].replicas: must be >= 1, got 0"
    data = _with("stages.1.replicas", 2)
    data["stages"][1]["devices"] = "0,1,2"
    assert _err(data) == (
        "stages[1].devices: 3 device(s) cannot be split evenly among 2 replicas"
        " (each replica takes its own, in order)"
    )
    # Through Ray: one actor per replica, with a placement each (or one for all)
    ray = _with("runtime", {"backend": "ray"}, _with("stages.1.replicas", 2))
    ray["stages"][1]["placement"] = [{"resources": {"node_a": 1}}, {"resources": {"node_b": 1}}]
    dit = resolve_spec(spec_from_dict(ray, env={})).stage(1)
    assert [c.placement["resources"] for c in (dit.for_replica(0), dit.for_replica(1))] == [
        {"node_a": 1},
        {"node_b": 1},
    ]
    ray["stages"][1]["placement"] = [{"resources": {"node_a": 1}}]
    assert _err(ray) == (
        "stages[1].placement: a list of 1 placement(s) for 2 replica(s) (one per replica, in order;"
        " or one placement for all)"
    )
    ray["stages"][1]["placement"] = [{"resources": {"GPU": 1}}, {"resources": {"node_b": 1}}]
    assert _err(ray) == "stages[1].placement: every replica holds the same GPU count (one platform per stage)"
    ray["stages"][1]["placement"] = [{}, {"resources": {"node_b": -1}}]
    assert _err(ray) == "stages[1].placement[1].resources.node_b: must be >= 0, got -1.0"
    # an auto edge may become either runtime connector: a fixed port there is refused too
    auto = _with("runtime", {"backend": "ray", "cross_node_connector": "z"}, _with("stages.1.replicas", 2))
    auto["connectors"]["z"] = {"name": "zmq", "extra": {"port": 5601}}
    del auto["edges"]
    assert _err(auto).startswith("stages[1].replicas: edge 0 -> 1 (z) fixes port 5601")
    auto["runtime"] = {"backend": "ray", "same_node_connector": "cuda_ipc"}
    assert _err(auto).startswith("stages[1].replicas: edge 0 -> 1 is (or may become) CUDA IPC")
    fixed = _with(
        "connectors", {"z": {"name": "zmq", "extra": {"port": 5601}}}, _with("stages.0.replicas", 2)
    )
    fixed["edges"][0]["connector"] = "z"
    assert _err(fixed) == (
        "stages[0].replicas: edge 0 -> 1 (z) fixes port 5601, which 2 replicas on one host cannot all bind"
        " (leave it 0: each picks a free one)"
    )
    external = _with("stages.0.url", "http://127.0.0.1:8000", _with("stages.0.replicas", 2))
    assert _err(external).startswith("stages[0].replicas: an external stage (url) is one server")
