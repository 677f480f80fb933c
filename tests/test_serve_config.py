"""Stage configs with external (``url``) stages, and the ``vllm serve`` command built for them."""

from __future__ import annotations

import itertools
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_kvbridge.config.resolve import resolve
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.pipeline import Pipeline
from vllm_kvbridge.pipeline.http_engine import vllm_serve_argv

ROOT = Path(__file__).resolve().parent.parent


def _config(tmp_path: Path, **stage0: object) -> Path:
    spec = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text())
    spec["stages"][0].update(stage0)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_url_stage_resolves_and_keeps_its_namespace(tmp_path: Path) -> None:
    plan = resolve(_config(tmp_path, url="http://127.0.0.1:8001/"))
    assert plan.stages[0].url == "http://127.0.0.1:8001" and plan.stages[0].is_external
    assert plan.stages[1].url is None
    pipe = Pipeline(plan)  # nothing starts before start()
    try:
        ns = [e.connector.config.get("namespace") for s in pipe.plan.stages for e in (*s.inputs, *s.outputs)]
        assert ns == [None, None]  # no run namespace: the external server was started from the file
        assert Pipeline.from_config(_config(tmp_path, url="http://h:1")).plan.stages[0].model is None
    finally:
        pipe.close()


@pytest.mark.parametrize(
    ("stage", "where", "message"),
    [
        (0, {"url": "127.0.0.1:8001"}, "stages[0].url: '127.0.0.1:8001' is not an http(s) URL"),
        (1, {"url": "http://127.0.0.1:8001"}, "stages[1].url: only LLM stages can be external"),
    ],
)
def test_bad_url_stages_are_rejected(tmp_path: Path, stage: int, where: dict, message: str) -> None:
    spec = yaml.safe_load((ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text())
    spec["stages"][stage].update(where)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError) as err:
        resolve(path)
    assert str(err.value).startswith(message)


def test_external_stage_cannot_receive(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "stage_configs/thinker_talker_full_payload.yaml").read_text())
    spec["stages"][1]["url"] = "http://127.0.0.1:8001"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"stages\[1\].url: an external stage takes the text prompt"):
        resolve(path)


def test_vllm_serve_command_carries_worker_settings_and_connector(tmp_path: Path) -> None:
    stage = resolve(_config(tmp_path, url="http://127.0.0.1:8001")).stages[0]
    argv = vllm_serve_argv(stage, "/models/tiny", port=8001)
    assert argv[:3] == ["vllm", "serve", "/models/tiny"]
    opts = dict(itertools.pairwise(argv))
    # A stage that only sends KV is a stock vLLM server: one --kv-transfer-config carries it all.
    assert opts["--port"] == "8001" and "--worker-cls" not in opts and "--additional-config" not in opts
    kv_transfer_config = json.loads(opts["--kv-transfer-config"])
    assert kv_transfer_config["kv_connector"] == "KVBridgeConnector"
    settings = kv_transfer_config["kv_connector_extra_config"]["kvbridge"]
    assert settings["stage_id"] == 0 and settings["kv_transfer"]["need_send_cache"] is True
    assert settings["kv_transfer"]["connector"] == "SharedMemoryConnector"
    assert "--enforce-eager" in argv and opts["--max-model-len"] == "512"

    # A False engine arg is said (left out, vLLM's default True would win), and vLLM's own
    # `vllm serve` parser reads every flag back as the config has it.
    engine_args = {"enable_prefix_caching": False, "enforce_eager": True, "disable_log_stats": False}
    with_false = resolve(_config(tmp_path, url="http://127.0.0.1:8001", engine_args=engine_args)).stages[0]
    argv = vllm_serve_argv(with_false, "/models/tiny", port=8001)
    assert "--no-enable-prefix-caching" in argv and "--disable-log-stats" not in argv
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    assert parsed.model_tag == "/models/tiny" and parsed.port == 8001
    assert parsed.enable_prefix_caching is False and parsed.enforce_eager is True
    assert parsed.disable_log_stats is False
    kv = parsed.kv_transfer_config
    assert (kv["kv_connector"] if isinstance(kv, dict) else kv.kv_connector) == "KVBridgeConnector"

    config = _config(tmp_path, url="http://127.0.0.1:8005")
    printed = subprocess.run(
        [sys.executable, "-m", "vllm_kvbridge.cli.main", "serve", "--stage-config",
         str(config), "--model", "/models/tiny", "--print-vllm-serve", "0"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert shlex.split(printed) == vllm_serve_argv(stage, "/models/tiny", port=8005)
    bad = subprocess.run(
        [sys.executable, "-m", "vllm_kvbridge.cli.main", "serve", "--stage-config",
         str(_config(tmp_path)), "--print-vllm-serve", "1"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "not an LLM stage" in bad.stderr
