"""Models that ship with the package, named in stage configs as ``kvbridge://<name>``.

Nothing can be downloaded in CI, so a stage config that needs a second model (the talker
of a thinker -> talker pipeline) names one the package writes itself, deterministic from
a seed: ``model: kvbridge://tiny-talker``. The stage process resolves the name to the
model's directory (written on first use, cached) just before it starts its engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vllm_kvbridge.errors import ConfigError

SCHEME = "kvbridge://"


def _tiny_talker() -> Path:
    from vllm_kvbridge.models.tiny_talker import ensure_tiny_talker

    return ensure_tiny_talker()


def _tiny_lm(arch: str) -> Callable[[], Path]:
    def make() -> Path:
        from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

        return ensure_tiny_model(arch=arch)

    return make


def _tiny_lm_names() -> dict[str, Callable[[], Path]]:
    from vllm_kvbridge.models.tiny_lm import ARCHS

    return {f"tiny-{arch}": _tiny_lm(arch) for arch in ARCHS}


#: ``tiny-<arch>`` for every architecture of :data:`vllm_kvbridge.models.tiny_lm.ARCHS`
#: (``tiny-llama``, ``tiny-qwen3``, ``tiny-gemma3``, ...) and the talker.
BUILTIN: dict[str, Callable[[], Path]] = {**_tiny_lm_names(), "tiny-talker": _tiny_talker}


def is_builtin(model: str | None) -> bool:
    return bool(model) and str(model).startswith(SCHEME)


def builtin_model(model: str | None) -> str | None:
    """``model`` itself, or the directory of the built-in model it names."""
    if not is_builtin(model):
        return model
    name = str(model)[len(SCHEME) :]
    make = BUILTIN.get(name)
    if make is None:
        raise ConfigError(
            f"model {model!r}: no built-in model {name!r} (known: {', '.join(sorted(BUILTIN))})"
        )
    return str(make())
