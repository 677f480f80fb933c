"""A diffusion stage's KV geometry, taken from the model of the LLM stage that sends it KV.

The DiT's cross-attention projects into the sender's K/V space, so its ``kv_heads`` /
``kv_head_dim`` must be the sender's. Writing them into ``diffusion.kwargs`` by hand made a
pipeline work for one model only; here the resolver reads the sending stage's model config
(its Hugging Face ``config.json``) and fills them, so the same stage config runs a tiny
Llama, a tiny Qwen3 with 4 KV heads or a real model without edits.

Rules (:func:`fill_kv_geometry`), per diffusion stage that receives KV from an LLM stage:

* the sender's model is read where that needs no network: a directory with a
  ``config.json``, a ``kvbridge://`` built-in (built once, cached), or a hub id whose
  ``config.json`` is already in the local Hugging Face cache;
* ``kv_heads`` / ``kv_head_dim`` the YAML does not set are filled (when the module's
  constructor takes them); ones it sets must agree with the model, else a ConfigError
  naming both;
* a model that cannot be read falls back to the YAML's values, else a ConfigError saying
  to set them;
* a sender whose model is not known yet (``--model`` comes later) is left for
  :meth:`ResolvedPipeline.with_model <vllm_kvbridge.config.resolve.ResolvedPipeline.with_model>`
  to fill once it is.

The runtime handshake (:mod:`vllm_kvbridge.kv.compat`) still checks every received KV
against what the module attends with. What was resolved is kept on the stage
(``ResolvedStage.kv_geometry``) for ``check-config`` to print.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_kvbridge.errors import ConfigError

if TYPE_CHECKING:
    from vllm_kvbridge.config.resolve import ResolvedPipeline, ResolvedStage

#: The module kwargs this fills, and the geometry field each one comes from.
GEOMETRY_KWARGS = (("kv_heads", "num_kv_heads"), ("kv_head_dim", "head_dim"))
#: Modules known to take both kwargs (no import needed to tell).
_KNOWN_TAKERS = frozenset(
    {"vllm_kvbridge.models.tiny_dit.TinyKVDiT", "vllm_kvbridge.models.tiny_dit:TinyKVDiT"}
)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class GeometryUnavailable(Exception):
    """The sender's model config cannot be read here (the message says why)."""


@dataclass(frozen=True)
class KVGeometry:
    """The shape of the KV a model's engine sends: per layer ``[tokens, num_kv_heads, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def describe(self) -> str:
        return f"{self.num_layers} layers, {self.num_kv_heads} KV heads, head_dim {self.head_dim}"


def geometry_from_config(config: dict[str, Any]) -> KVGeometry:
    """The KV geometry of a Hugging Face ``config.json`` (its ``text_config`` for a
    multimodal model). ``num_key_value_heads`` falls back to ``num_attention_heads`` (no
    grouped-query attention), ``head_dim`` to ``hidden_size / num_attention_heads``."""
    if "num_hidden_layers" not in config and isinstance(config.get("text_config"), dict):
        config = config["text_config"]
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise GeometryUnavailable(f"its config.json has no usable {exc} for the KV geometry") from None
    if min(layers, kv_heads, head_dim) < 1:
        raise GeometryUnavailable(
            f"its config.json gives {layers} layers, {kv_heads} KV heads, head_dim {head_dim}"
        )
    return KVGeometry(layers, kv_heads, head_dim)


def _config_file(model: str) -> Path:
    """Where ``model``'s config.json is on this host, without the network."""
    from vllm_kvbridge.models.builtin import builtin_model, is_builtin

    if is_builtin(model):
        # Building a built-in is cheap and cached; its stage would build it anyway.
        return Path(str(builtin_model(model))) / "config.json"
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise GeometryUnavailable(f"the directory {str(path)!r} has no config.json")
        return path / "config.json"
    if path.is_absolute() or model.startswith((".", "~")) or not _HUB_ID.fullmatch(model):
        raise GeometryUnavailable(f"no such model directory {model!r}")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
    except Exception as exc:  # a malformed id or an unreadable cache: not readable here
        raise GeometryUnavailable(f"cannot look {model!r} up in the Hugging Face cache: {exc}") from None
    if not isinstance(cached, str):
        # No download at config time: check-config must answer offline and at once.
        raise GeometryUnavailable(
            f"{model!r} is not a local directory and its config.json is not in the Hugging Face "
            f"cache (nothing is downloaded at config time; `huggingface-cli download {model} "
            "config.json` fetches it)"
        )
    return Path(cached)


def read_model_geometry(model: str) -> KVGeometry:
    """The KV geometry of ``model`` (a directory, a ``kvbridge://`` built-in, or a hub id in
    the local Hugging Face cache); :class:`GeometryUnavailable` when it cannot be read here."""
    path = _config_file(model)
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GeometryUnavailable(f"cannot read {str(path)!r}: {exc}") from None
    if not isinstance(config, dict):
        raise GeometryUnavailable(f"{str(path)!r} is not a JSON object")
    return geometry_from_config(config)


def module_takes_geometry(class_path: str) -> bool:
    """Whether ``class_path(**kwargs)`` takes ``kv_heads`` and ``kv_head_dim`` (named, or
    through ``**kwargs``). A class that cannot be imported here counts as taking them:
    its stage builds it (and reports a bad path) at start."""
    if class_path in _KNOWN_TAKERS:
        return True
    module_name, sep, attr = class_path.partition(":")
    if not sep:
        module_name, _, attr = class_path.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        params = inspect.signature(obj).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    names = {p.name for p in params}
    return all(key in names for key, _ in GEOMETRY_KWARGS)


def _kv_sender(plan: ResolvedPipeline, stage: ResolvedStage) -> ResolvedStage | None:
    for edge in stage.inputs:
        if edge.kv:
            sender = plan.stage(edge.from_stage)
            if sender.is_llm:
                return sender
    return None


def _resolve_stage_geometry(
    index: int, stage: ResolvedStage, sender: ResolvedStage, model: str
) -> ResolvedStage:
    path = f"stages[{index}].diffusion.kwargs"
    diffusion = dict(stage.diffusion or {})
    kwargs = dict(diffusion.get("kwargs") or {})
    record: dict[str, Any] = {"from_stage": sender.stage_id, "model": model, "filled": []}
    try:
        geometry = read_model_geometry(model)
    except GeometryUnavailable as why:
        missing = [key for key, _ in GEOMETRY_KWARGS if key not in kwargs]
        if missing and module_takes_geometry(str(diffusion.get("class_path"))):
            raise ConfigError(
                f"{path}: cannot read the KV geometry of stage {sender.stage_id}'s model {model!r} ({why}); "
                f"set {' and '.join(missing)} in {path} to the model's KV heads and head_dim"
            ) from None
        record.update(source="yaml", reason=str(why))
        return msgspec.structs.replace(stage, kv_geometry=record)
    for key, field in GEOMETRY_KWARGS:
        want = getattr(geometry, field)
        if key in kwargs and kwargs[key] != want:
            raise ConfigError(
                f"{path}.{key}: {kwargs[key]!r} in the stage config, but stage {sender.stage_id}'s model "
                f"{model!r} sends KV with {field} {want} ({geometry.describe()}); remove {key} to take "
                "the sender's value"
            )
    takes = module_takes_geometry(str(diffusion.get("class_path")))
    if takes:
        for key, field in GEOMETRY_KWARGS:
            if key not in kwargs:
                kwargs[key] = getattr(geometry, field)
                record["filled"].append(key)
    record.update(
        source="model",
        module_takes_it=takes,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
    )
    diffusion["kwargs"] = kwargs
    return msgspec.structs.replace(stage, diffusion=diffusion, kv_geometry=record)


def fill_kv_geometry(plan: ResolvedPipeline, default_model: str | None = None) -> ResolvedPipeline:
    """``plan`` with every KV-receiving diffusion stage's geometry resolved from its sender's
    model (``default_model`` for a sender that names none; such a sender is skipped when
    it is None). Stages already resolved are kept: the first model that was known wins."""
    stages = list(plan.stages)
    for i, stage in enumerate(stages):
        if stage.kind != "diffusion" or stage.kv_geometry is not None:
            continue
        sender = _kv_sender(plan, stage)
        model = (sender.model or default_model) if sender is not None else None
        if sender is None or not model:
            continue
        stages[i] = _resolve_stage_geometry(i, stage, sender, str(model))
    return msgspec.structs.replace(plan, stages=stages)


def describe_geometry(stage: ResolvedStage) -> str | None:
    """One line for ``check-config``: where the stage's KV geometry came from."""
    g = stage.kv_geometry
    if g is None:
        return None
    head = f"DiT KV geometry from stage {g['from_stage']}'s model {g['model']}"
    if g.get("source") != "model":
        return f"{head}: not readable here ({g.get('reason')}); the stage config's kwargs are used"
    shape = KVGeometry(g["num_layers"], g["num_kv_heads"], g["head_dim"]).describe()
    filled = g.get("filled") or []
    if filled:
        how = f"filled {', '.join(filled)}"
    elif g.get("module_takes_it", True):
        how = "the stage config's kwargs agree"
    else:
        how = "the module takes no kv_heads / kv_head_dim: nothing filled"
    return f"{head}: {shape} ({how})"


__all__ = [
    "GEOMETRY_KWARGS",
    "GeometryUnavailable",
    "KVGeometry",
    "describe_geometry",
    "fill_kv_geometry",
    "geometry_from_config",
    "module_takes_geometry",
    "read_model_geometry",
]
