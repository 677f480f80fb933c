"""``--model`` / ``--arch``: the model of LLM stages that name none, shared by the commands.

``--model DIR`` names it; ``--arch ARCH`` picks the tiny offline model of that architecture
(``kvbridge://tiny-<arch>``, built once into the cache); neither: the tiny Llama. The two
exclude each other (argparse says so and exits 2).
"""

from __future__ import annotations

import argparse

DEFAULT_ARCH = "llama"


def add_model_arguments(p: argparse.ArgumentParser, model_help: str | None = None) -> None:
    from vllm_kvbridge.models.tiny_lm import ARCHS

    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--model",
        help=model_help or "model for LLM stages that name none (default: the tiny offline model)",
    )
    group.add_argument(
        "--arch",
        choices=sorted(ARCHS),
        help="use the tiny offline model of this architecture (kvbridge://tiny-ARCH) for LLM "
        "stages that name none (default: llama; not with --model)",
    )


def tiny_model_name(arch: str | None) -> str:
    """The built-in name of the tiny model ``--arch`` picks (``kvbridge://tiny-llama`` by default)."""
    return f"kvbridge://tiny-{arch or DEFAULT_ARCH}"


def tiny_model(arch: str | None) -> str:
    """The directory of the tiny model of ``arch`` (default Llama), built once into the cache."""
    from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

    return str(ensure_tiny_model(arch=arch or DEFAULT_ARCH))


def chosen_model(args: argparse.Namespace) -> str | None:
    """``--model``, or the tiny model's directory where ``--arch`` was given, else None
    (the caller decides whether the default tiny Llama is needed)."""
    if getattr(args, "model", None):
        return str(args.model)
    if getattr(args, "arch", None):
        return tiny_model(args.arch)
    return None


def describe_tiny(arch: str | None, path: str) -> str:
    """The line a command prints when it picked a tiny model."""
    from vllm_kvbridge.models.tiny_lm import ARCHS

    name = ARCHS[arch or DEFAULT_ARCH].architecture.removesuffix("ForCausalLM")
    return f"model: tiny offline {name} ({tiny_model_name(arch)}) at {path}"


__all__ = [
    "DEFAULT_ARCH",
    "add_model_arguments",
    "chosen_model",
    "describe_tiny",
    "tiny_model",
    "tiny_model_name",
]
