"""``vllm-kvbridge`` entry point.

Each sub-command lives in its own module exposing ``add_parser(subparsers)``, which
registers an argparse parser whose ``func`` default takes the parsed namespace and
returns an exit code. Modules are imported here explicitly (a missing or broken
module is a real error, not a silently absent command).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SUBCOMMAND_MODULES: list[str] = [
    "vllm_kvbridge.cli.tiny_model",
    "vllm_kvbridge.cli.demo",
    "vllm_kvbridge.cli.check_config",
    "vllm_kvbridge.cli.run",
    "vllm_kvbridge.cli.bench",
    "vllm_kvbridge.cli.serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-kvbridge",
        description="Move KV caches and stage payloads between the stages of vLLM pipelines.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
