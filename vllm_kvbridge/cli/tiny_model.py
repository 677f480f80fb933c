"""``vllm-kvbridge make-tiny-model DIR [--arch ARCH]``: write an offline tiny random-weight LM."""

from __future__ import annotations

import argparse
from dataclasses import fields

from vllm_kvbridge.models.tiny_lm import ARCHS, TinyLMSpec, make_tiny_model

_OPTIONS = {
    "seed": "random seed of the weights (same seed -> byte-identical files)",
    "layers": "number of decoder layers",
    "hidden": "hidden size (= heads * head_dim; head_dim must be >= 32)",
    "heads": "attention heads",
    "kv_heads": "key/value heads (fewer than heads gives grouped-query attention)",
    "vocab": "vocabulary size of the byte-level BPE tokenizer",
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-tiny-model",
        help="write a tiny random-weight model of one architecture (no network needed)",
        description="Write a tiny random-weight causal LM (Llama, Qwen, Gemma, ...) with a real "
        "tokenizer into DIR.",
    )
    p.add_argument("dir", help="output directory (created if missing)")
    p.add_argument(
        "--arch",
        choices=sorted(ARCHS),
        default="llama",
        help="architecture; transformers builds it from a small config (default: llama)",
    )
    defaults = {f.name: f.default for f in fields(TinyLMSpec)}
    for name, help_text in _OPTIONS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=defaults[name],
            help=f"{help_text} (default: {defaults[name]})",
        )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    spec = TinyLMSpec(arch=args.arch, **{name: getattr(args, name) for name in _OPTIONS})
    try:
        out = make_tiny_model(args.dir, spec)
    except ValueError as exc:
        raise SystemExit(f"vllm-kvbridge make-tiny-model: {exc}") from None
    print(
        f"wrote tiny {ARCHS[spec.arch].architecture} model ({spec.layers} layers, hidden {spec.hidden}, "
        f"{spec.heads} heads / {spec.kv_heads} kv heads, vocab {spec.vocab}, seed {spec.seed}) to {out}"
    )
    return 0
