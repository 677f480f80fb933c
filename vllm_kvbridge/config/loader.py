"""Read a stage-config YAML file into :class:`~vllm_kvbridge.config.schema.PipelineSpec`.

Steps: ``yaml.safe_load`` (no Python tags, no code), ``${ENV}`` expansion on every
string scalar (``${VAR}`` or ``${VAR:-default}``; a scalar that is exactly one
reference is re-read as YAML so ``${TP:-2}`` becomes the int 2), then msgspec
conversion. Every error is a :class:`ConfigError` whose message starts with the key
path, e.g. ``stages[1].kv_transfer.trigger: Invalid enum value 'later'``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from vllm_kvbridge.config.schema import ConnectorSpec, PipelineSpec
from vllm_kvbridge.errors import ConfigError

_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_MSGSPEC_PATH = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def format_path(parts: list[str | int]) -> str:
    """``["stages", 1, "kind"]`` -> ``stages[1].kind``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def expand_env(value: Any, env: Mapping[str, str] | None = None, path: list[str | int] | None = None) -> Any:
    """Expand ``${VAR}`` / ``${VAR:-default}`` in every string of a parsed YAML tree."""
    env = os.environ if env is None else env
    path = path or []
    if isinstance(value, dict):
        return {k: expand_env(v, env, [*path, str(k)]) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, env, [*path, i]) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def sub(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in env:
            return env[name]
        if default is not None:
            return default
        raise ConfigError(
            f"{format_path(path)}: environment variable ${{{name}}} is not set "
            "(set it or write ${" + name + ":-default})"
        )

    whole = _REF.fullmatch(value)
    expanded = _REF.sub(sub, value)
    if whole is not None:
        # A scalar that is one reference takes the YAML type of what it expands to.
        try:
            return yaml.safe_load(expanded) if expanded.strip() else expanded
        except yaml.YAMLError:
            return expanded
    return expanded


def _msgspec_error(exc: msgspec.ValidationError) -> ConfigError:
    text = str(exc)
    match = _MSGSPEC_PATH.match(text)
    msg, path = (match.group("msg"), match.group("path")) if match else (text, None)
    path = (path or "").lstrip(".") or "<root>"
    unknown = re.fullmatch(r"Object contains unknown field `([^`]*)`", msg)
    if unknown:
        key = unknown.group(1)
        return ConfigError(f"{path + '.' if path != '<root>' else ''}{key}: unknown key")
    return ConfigError(f"{path}: {msg[0].lower() + msg[1:] if msg else msg}")


def spec_from_dict(data: Any, env: Mapping[str, str] | None = None) -> PipelineSpec:
    """Validate an already-parsed config tree (``${ENV}`` is expanded first)."""
    if not isinstance(data, dict):
        raise ConfigError(f"<root>: expected a mapping with a 'stages' list, got {type(data).__name__}")
    data = expand_env(data, env)
    connectors = data.get("connectors")
    if isinstance(connectors, dict):
        # msgspec names a dict entry "[...]"; check entries one by one to name the key.
        for name, value in connectors.items():
            try:
                msgspec.convert(value, ConnectorSpec, strict=True)
            except msgspec.ValidationError as exc:
                err = _msgspec_error(exc)
                raise ConfigError(
                    f"connectors.{name}"
                    + (f".{err}" if not str(err).startswith("<root>") else str(err)[len("<root>") :])
                ) from None
    try:
        return msgspec.convert(data, PipelineSpec, strict=True)
    except msgspec.ValidationError as exc:
        raise _msgspec_error(exc) from None


def load_spec(path: str | Path, env: Mapping[str, str] | None = None) -> PipelineSpec:
    """Parse and type-check a YAML stage config (no cross-field checks; see ``resolve``)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read stage config: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{p}: invalid YAML{where}: {problem}") from None
    return spec_from_dict(data, env)
