"""Issue 39, item 4: a diffusion stage's KV geometry comes from its sender's model.

Config resolution only (no engine): real tiny models written by ``make-tiny-model`` with a
non-default geometry, the shipped stage configs, and ``check-config`` through its command
line.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch import nn

from vllm_kvbridge.cli.main import main as cli
from vllm_kvbridge.config import resolve_spec, spec_from_dict
from vllm_kvbridge.config.kv_geometry import (
    GeometryUnavailable,
    KVGeometry,
    geometry_from_config,
    read_model_geometry,
)
from vllm_kvbridge.config.resolve import resolve
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.models.tiny_dit import TinyKVDiT

ROOT = Path(__file__).resolve().parents[1]
SHM = ROOT / "stage_configs/ar_to_dit_shm.yaml"


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 unlike the default geometry: 3 layers, 4 KV heads of 64 (hidden 512 / 8)."""
    out = tmp_path_factory.mktemp("geom") / "qwen3"
    argv = ["make-tiny-model", str(out), "--arch", "qwen3", "--layers", "3", "--kv-heads", "4"]
    assert cli([*argv, "--hidden", "512", "--heads", "8"]) == 0
    return out


class NoKVModule(nn.Module):
    """A DiT whose constructor takes no KV geometry (it reads it from the KV)."""

    def __init__(self, image_size: int = 16) -> None:
        super().__init__()
        self.latent_shape = (3, image_size, image_size)


def _config(model: str | None, kwargs: dict[str, Any] | None = None, class_path: str | None = None) -> Any:
    data = yaml.safe_load(SHM.read_text())
    data = copy.deepcopy(data)
    data.pop("model", None)
    if model is not None:
        data["stages"][0]["model"] = model
    dit = data["stages"][1]["diffusion"]
    dit["kwargs"] = {"image_size": 16, **(kwargs or {})}
    if class_path is not None:
        dit["class_path"] = class_path
    return spec_from_dict(data, env={})


def test_the_shipped_configs_leave_the_geometry_to_the_sender() -> None:
    for path in sorted((ROOT / "stage_configs").glob("ar_to_dit*.yaml")):
        kwargs = yaml.safe_load(path.read_text())["stages"][1]["diffusion"]["kwargs"]
        assert "kv_heads" not in kwargs and "kv_head_dim" not in kwargs, path.name


def test_geometry_is_filled_from_the_senders_model(qwen3_dir: Path) -> None:
    stage = resolve_spec(_config(str(qwen3_dir))).stage(1)
    assert stage.diffusion["kwargs"]["kv_heads"] == 4 and stage.diffusion["kwargs"]["kv_head_dim"] == 64
    assert stage.kv_geometry == {
        "from_stage": 0,
        "model": str(qwen3_dir),
        "filled": ["kv_heads", "kv_head_dim"],
        "source": "model",
        "module_takes_it": True,
        "num_layers": 3,
        "num_kv_heads": 4,
        "head_dim": 64,
    }
    # The module the stage builds projects into the sender's K/V space.
    dit = TinyKVDiT(**stage.diffusion["kwargs"])
    assert (dit.kv_heads, dit.kv_head_dim) == (4, 64)


def test_a_model_given_later_fills_it_once(qwen3_dir: Path) -> None:
    """``--model`` (run, serve, Pipeline.from_config) comes after the config is resolved."""
    plan = resolve(SHM, env={})
    assert plan.stage(1).kv_geometry is None and "kv_heads" not in plan.stage(1).diffusion["kwargs"]
    plan = plan.with_model(str(qwen3_dir))
    assert plan.stage(1).diffusion["kwargs"]["kv_heads"] == 4
    assert plan.stage(1).kv_geometry["num_layers"] == 3
    # already resolved: another with_model (a stage that now names its model) changes nothing
    assert plan.with_model("/elsewhere").stage(1) == plan.stage(1)


def test_kwargs_that_agree_are_kept(qwen3_dir: Path) -> None:
    stage = resolve_spec(_config(str(qwen3_dir), {"kv_heads": 4, "kv_head_dim": 64})).stage(1)
    assert stage.kv_geometry["filled"] == [] and stage.diffusion["kwargs"]["kv_heads"] == 4


@pytest.mark.parametrize(
    ("kwargs", "key", "ours", "theirs"),
    [
        ({"kv_heads": 2}, "kv_heads", "2", "num_kv_heads 4"),
        ({"kv_head_dim": 32}, "kv_head_dim", "32", "head_dim 64"),
    ],
)
def test_kwargs_that_contradict_the_sender_fail_naming_both(
    qwen3_dir: Path, kwargs: dict[str, int], key: str, ours: str, theirs: str
) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_spec(_config(str(qwen3_dir), kwargs))
    msg = str(err.value)
    assert msg.startswith(f"stages[1].diffusion.kwargs.{key}: {ours} in the stage config")
    assert f"stage 0's model '{qwen3_dir}' sends KV with {theirs}" in msg and f"remove {key}" in msg
    # the same through the model the run path gives later
    with pytest.raises(ConfigError, match=theirs):
        resolve_spec(_config(None, kwargs)).with_model(str(qwen3_dir))


def test_an_unreadable_model_falls_back_to_the_kwargs_or_fails_saying_to_set_them(tmp_path: Path) -> None:
    no_config = tmp_path / "weights-only"
    no_config.mkdir()
    for model, why in (
        (str(no_config), "has no config.json"),
        (str(tmp_path / "missing"), "no such model directory"),
        ("kvbridge-tests/never-downloaded", "not in the Hugging Face cache"),
    ):
        with pytest.raises(ConfigError) as err:
            resolve_spec(_config(model))
        msg = str(err.value)
        assert msg.startswith("stages[1].diffusion.kwargs: cannot read the KV geometry of stage 0's model")
        assert why in msg and "set kv_heads and kv_head_dim in stages[1].diffusion.kwargs" in msg
        with pytest.raises(ConfigError, match="set kv_head_dim in"):
            resolve_spec(_config(model, {"kv_heads": 2}))
        stage = resolve_spec(_config(model, {"kv_heads": 8, "kv_head_dim": 128})).stage(1)
        assert stage.diffusion["kwargs"]["kv_heads"] == 8 and stage.kv_geometry["source"] == "yaml"
        assert why in stage.kv_geometry["reason"]


def test_a_module_without_geometry_kwargs_gets_none(qwen3_dir: Path) -> None:
    stage = resolve_spec(_config(str(qwen3_dir), class_path=f"{__name__}.NoKVModule")).stage(1)
    assert "kv_heads" not in stage.diffusion["kwargs"] and stage.kv_geometry["num_kv_heads"] == 4
    assert stage.kv_geometry["module_takes_it"] is False
    # nor does it need the sender's model to be readable
    stage = resolve_spec(_config("/no/such/model", class_path=f"{__name__}.NoKVModule")).stage(1)
    assert stage.kv_geometry["source"] == "yaml"


def test_geometry_from_config_fallbacks() -> None:
    # no num_key_value_heads: every head is a KV head; no head_dim: hidden / heads
    assert geometry_from_config(
        {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 1024}
    ) == KVGeometry(4, 8, 128)
    # an explicit head_dim wins over hidden / heads (Qwen3, Gemma: they differ)
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64}
    assert geometry_from_config({**config, "head_dim": 256}) == KVGeometry(2, 2, 256)
    # a multimodal model's text side
    assert geometry_from_config({"text_config": config}) == KVGeometry(2, 2, 8)
    with pytest.raises(GeometryUnavailable, match="num_attention_heads"):
        geometry_from_config({"num_hidden_layers": 2})


def test_builtin_models_are_read(qwen3_dir: Path) -> None:
    """``kvbridge://tiny-<arch>`` is built (cached) and read like a directory."""
    got = read_model_geometry("kvbridge://tiny-qwen3")
    assert got == KVGeometry(2, 2, 32)
    with pytest.raises(ConfigError, match="no built-in model 'tiny-nope'"):
        resolve_spec(_config("kvbridge://tiny-nope"))


def _check_config(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = cli(["check-config", str(SHM), "--platform", "cpu", *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_check_config_prints_the_geometry(qwen3_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _check_config(capsys)
    assert code == 0, out
    assert "model=<--model / tiny model>" in out  # the plan itself still names no model
    want = "DiT KV geometry from stage 0's model kvbridge://tiny-llama: 2 layers, 2 KV heads, head_dim 32"
    assert f"{want} (filled kv_heads, kv_head_dim)" in out
    code, out = _check_config(capsys, "--model", str(qwen3_dir))
    assert code == 0, out
    assert f"from stage 0's model {qwen3_dir}: 3 layers, 4 KV heads, head_dim 64" in out
    code, out = _check_config(capsys, "--arch", "qwen3", "--json")
    assert code == 0, out
    stage = json.loads(out)["stages"][1]
    assert stage["kv_geometry"]["model"] == "kvbridge://tiny-qwen3"
    assert stage["diffusion"]["kwargs"]["kv_heads"] == 2


def test_check_config_fails_on_a_contradiction(
    qwen3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load(SHM.read_text())
    data["stages"][1]["diffusion"]["kwargs"]["kv_heads"] = 2
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump(data))
    code = cli(["check-config", str(path), "--model", str(qwen3_dir)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: stages[1].diffusion.kwargs.kv_heads: 2 in the stage config")


def test_arch_and_model_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    for command in (
        ["run", "--stage-config", str(SHM), "--prompt", "x"],
        ["serve", "--stage-config", str(SHM)],
    ):
        with pytest.raises(SystemExit) as exc:
            cli([*command, "--arch", "qwen3", "--model", "/m"])
        assert exc.value.code == 2
        assert "argument --model: not allowed with argument --arch" in capsys.readouterr().err


def test_serve_prints_the_vllm_command_of_the_arch_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``serve --arch`` names the tiny model of that architecture for a stage naming none."""
    from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

    data = yaml.safe_load(SHM.read_text())
    data["stages"][0]["url"] = "http://127.0.0.1:8005"
    path = tmp_path / "external.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli(["serve", "--stage-config", str(path), "--arch", "qwen3", "--print-vllm-serve", "0"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[:3] == ["vllm", "serve", str(ensure_tiny_model(arch="qwen3"))]
