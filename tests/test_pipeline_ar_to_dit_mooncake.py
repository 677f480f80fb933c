"""AR -> DiT through a real ``mooncake_master`` (``stage_configs/ar_to_dit_mooncake.yaml``).

Real stage processes (one vLLM engine + the diffusion runner) and a real master with its
HTTP metadata server on loopback, started and stopped by ``vllm-kvbridge run
--start-mooncake-master``: the KV the DiT consumed is transformers', the images are the
ones denoised from it, and the store holds no key afterwards. How the addresses of a
master started elsewhere reach the config (``${KVB_MOONCAKE_*}``) is checked without
engines (past the config, a pipeline runs the same either way); the store connector against
such a master is tested across processes in ``test_connector_mooncake.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pipeline_fixtures import ROOT, check_kv_is_greedy_transformers_kv, dumped_kv, processes_using

from vllm_kvbridge.cli.main import main as cli_main
from vllm_kvbridge.cli.run import use_mooncake_master, uses_mooncake
from vllm_kvbridge.config.resolve import resolve
from vllm_kvbridge.connectors.keys import encode_request_id
from vllm_kvbridge.models.tiny_dit import TinyKVDiT
from vllm_kvbridge.models.tiny_lm import ensure_tiny_model
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.runner.diffusion_runner import denoise

CONFIG = ROOT / "stage_configs/ar_to_dit_mooncake.yaml"
DIT_KWARGS = {"image_size": 32, "patch_size": 4, "hidden": 64, "depth": 2, "kv_heads": 2, "kv_head_dim": 32}


def _expected_image(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return denoise(TinyKVDiT(**DIT_KWARGS, seed=0).eval(), kv, num_steps=8, seed=0)[0]


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.forked
@pytest.mark.long(300, "`run` through the CLI with its own mooncake_master: a pipeline start")
def test_run_starts_and_stops_its_own_mooncake_master(tmp_path: Path) -> None:
    model = ensure_tiny_model()
    out_dir = tmp_path
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVB_MOONCAKE_")}
    prompts = ["A cute cat", "The quick brown fox jumps over the lazy dog. " * 3]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_kvbridge.cli.main",
            "run",
            "--stage-config",
            str(CONFIG),
            "--start-mooncake-master",
            "--prompt",
            prompts[0],
            "--prompt",
            prompts[1],
            "--model",
            str(model),
            "--output-dir",
            str(out_dir),
            "--debug-dump-dir",
            str(out_dir / "dump"),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    started = re.search(
        r"mooncake_master: 127\.0\.0\.1:\d+, metadata http://127\.0\.0\.1:\d+/metadata \(pid (\d+)",
        proc.stdout,
    )
    assert started, proc.stdout
    assert "mooncake_master: stopped, 0 keys left in the store" in proc.stdout
    with pytest.raises(ProcessLookupError):
        os.kill(int(started.group(1)), 0)
    assert (out_dir / "logs" / "mooncake_master.log").stat().st_size > 0
    import numpy as np

    from vllm_kvbridge.pipeline.images import encode_png

    max_tokens = resolve(CONFIG, env={}).stages[0].default_sampling_params["max_tokens"]
    reqs = json.loads((out_dir / "result.json").read_text())["requests"]
    assert [r["prompt"] for r in reqs] == prompts
    pngs = []
    for req in reqs:
        assert req["error"] is None and req["image_shape"] == [3, 32, 32]
        assert req["transfers"][0]["what"] == "kv" and req["transfers"][0]["bytes"] > 0
        kv = dumped_kv(out_dir / "dump" / f"stage1_{encode_request_id(req['request_id'])}_kv.safetensors")
        # result.json does not carry the LLM stage's tokens: its greedy continuation is computed
        check_kv_is_greedy_transformers_kv(model, req["prompt"], kv, max_tokens)
        pngs.append(Path(req["outputs"][0]).read_bytes())
        assert pngs[-1] == encode_png(np.asarray(_expected_image(kv)))
    assert pngs[0] != pngs[1]
    assert processes_using(out_dir) == []  # stages and master are gone


def test_start_mooncake_master_rewrites_only_mooncake_edges() -> None:
    plan = resolve(CONFIG, env={})
    assert uses_mooncake(plan) and not uses_mooncake(resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml"))
    ends = [e.connector for s in plan.stages for e in (*s.inputs, *s.outputs)]
    assert {c.config["master_server_address"] for c in ends} == {"127.0.0.1:50051"}  # the defaults
    moved = use_mooncake_master(plan, "127.0.0.1:1234", "http://127.0.0.1:5678/metadata")
    for before, after in zip(ends, [e.connector for s in moved.stages for e in (*s.inputs, *s.outputs)]):
        assert after.config["master_server_address"] == "127.0.0.1:1234"
        assert after.config["metadata_server"] == "http://127.0.0.1:5678/metadata"
        # everything else (local_hostname per end, segment sizes) is kept
        assert {
            k: v for k, v in after.config.items() if k not in ("master_server_address", "metadata_server")
        } == {k: v for k, v in before.config.items() if k not in ("master_server_address", "metadata_server")}
    assert plan.stages[0].outputs[0].connector.config["master_server_address"] == "127.0.0.1:50051"  # a copy


def test_config_env_overrides_addresses_per_end() -> None:
    env = {
        "KVB_MOONCAKE_MASTER": "10.0.0.1:50051",
        "KVB_MOONCAKE_METADATA": "http://10.0.0.1:8080/metadata",
        "KVB_MOONCAKE_HOST_0": "10.0.0.2",
        "KVB_MOONCAKE_HOST_1": "10.0.0.3",
        "KVB_MOONCAKE_PROTOCOL": "rdma",
        "KVB_MOONCAKE_DEVICE_0": "mlx5_0",
    }
    plan = resolve(CONFIG, env=env)
    send, recv = plan.stages[0].outputs[0].connector.config, plan.stages[1].inputs[0].connector.config
    assert send["local_hostname"] == "10.0.0.2" and recv["local_hostname"] == "10.0.0.3"
    assert send["master_server_address"] == recv["master_server_address"] == "10.0.0.1:50051"
    assert send["protocol"] == recv["protocol"] == "rdma" and send["device_name"] == "mlx5_0"
    assert send["global_segment_size"] == "256MiB" and recv["global_segment_size"] == 0
    # runs sharing a master never collide: each run's keys live in its own namespace
    # nothing starts before start(); the model is read for the DiT's KV geometry only
    pipe = Pipeline(plan.with_model("kvbridge://tiny-llama"))
    try:
        ends = [e.connector.config for s in pipe.plan.stages for e in (*s.inputs, *s.outputs)]
        assert [c["namespace"] for c in ends] == [f"{pipe.run_id}-0-1"] * 2
        assert ends[0]["master_server_address"] == "10.0.0.1:50051"
    finally:
        pipe.close()


def test_start_mooncake_master_without_a_mooncake_edge_is_a_config_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = cli_main(
        [
            "run",
            "--stage-config",
            str(ROOT / "stage_configs/ar_to_dit_shm.yaml"),
            "--start-mooncake-master",
            "--prompt",
            "x",
        ]
    )
    assert code == 2
    assert "--start-mooncake-master: the config uses no MooncakeStoreConnector" in capsys.readouterr().err


def test_start_mooncake_master_fails_cleanly_without_the_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_kvbridge.connectors import mooncake_master as mm

    monkeypatch.setattr(mm.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    code = cli_main(
        [
            "run",
            "--stage-config",
            str(CONFIG),
            "--start-mooncake-master",
            "--prompt",
            "x",
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    assert code == 3
    assert "mooncake_master is neither next to" in capsys.readouterr().err
