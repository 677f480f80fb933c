"""``vllm-kvbridge bench``: measurements.

Sub-commands: ``connectors``, ``ar-overhead``, ``kv-path``, ``handoff``, ``soak``, ``gpu-path``,
``speech``, ``scale``, and ``all`` (every bench, one table of ratios to ceilings measured in the same run).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure transports and pipelines",
        description="Benchmarks that report ratios to ceilings measured in the same run.",
    )
    bench_sub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    c = bench_sub.add_parser(
        "connectors",
        help="connector throughput vs memcpy and the transport's bare ceiling",
        description="Move KV-shaped payloads from a sender process to a receiver process through each "
        "connector; print put/get/end-to-end times, GB/s and ratios to memcpy and to the "
        "transport's own ceiling (bare pyzmq; one write + one read of a shm segment).",
    )
    c.add_argument(
        "--connectors", default="shm,zmq", help="comma-separated names or aliases (default: shm,zmq)"
    )
    c.add_argument(
        "--sizes",
        default="64KB,1MB,64MB,512MB",
        help="comma-separated sizes, binary units (default: 64KB,1MB,64MB,512MB)",
    )
    c.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="timed transfers per point, after one warm-up (median reported; default 5)",
    )
    c.add_argument("--json", metavar="OUT", help="also write the rows as JSON to OUT")
    c.set_defaults(func=_run_connectors)
    # The other benches: (name, help, description, runner); each one's arguments come from
    # the module of that name (``-`` as ``_``) under vllm_kvbridge.bench, imported here as
    # the parser is built.
    benches: tuple[tuple[str, str, str, Callable[[argparse.Namespace], int]], ...] = (
        (
            "ar-overhead",
            "AR decode throughput with kvbridge KV sending on vs off",
            "Alternate timed batches between a plain vLLM engine and a kvbridge stage sending every "
            "request's KV on finish (KV-heavy model); print min/median tokens/s of both, the per-pair ratio "
            "and the noise floor of plain-vs-plain repeats.",
            _run_ar_overhead,
        ),
        (
            "kv-path",
            "a finished request's KV: vLLM engine to the receiver's tensors, per connector",
            "Time from a vLLM engine's output for a request to a receiver holding its KV "
            "(KV-heavy model, prompts of --tokens tokens), per connector; print latency, GB/s and the ratio "
            "to a memcpy of the same bytes measured in the same run.",
            _run_kv_path,
        ),
        (
            "handoff",
            "latency from a put to a usable object on the receiver, per connector and size",
            "Hand stage payloads (1KB/64KB/1MB by default) from a sender process to a receiver "
            "process that is already waiting, through each connector (Connector.get with a deadline, and the "
            "stages' PayloadSender -> PayloadReceiver); print p50/p99 ms and the ratio to the bare "
            "transport's one-way latency measured in the same run. --pipeline CONFIG adds a real pipeline's "
            "handoff.",
            _run_handoff,
        ),
        (
            "soak",
            "load, client aborts and stage kills against a real server",
            "Drive `vllm-kvbridge serve` with many concurrent requests, abandon some, kill stages; "
            "print ok / failed / aborted, latency vs the unloaded latency, recovery seconds and leftovers.",
            _run_soak,
        ),
        (
            "gpu-path",
            "the KV send path on a GPU (staged and direct) vs pinned D2H and D2D copies",
            "Gather a request's KV out of CUDA paged caches on the staged path (pinned pool, side "
            "stream, fence) and the direct path (a shared-memory segment); print caller and completion ms, "
            "GB/s and the ratio to a pinned device-to-host copy of the same bytes (and a device-to-device "
            "copy) measured in the same run. Plain torch, no vLLM.",
            _run_gpu_path,
        ),
        (
            "speech",
            "the streaming speech pipeline through serve: first packet and real-time factor",
            "Start `vllm-kvbridge serve` on the shipped thinker -> talker -> vocoder config and stream "
            "POST /v1/audio/speech (SSE) at each --concurrency; print first-packet latency and the real-time "
            "factor (per request and aggregate), each as a ratio to a ceiling measured in the same run: each "
            "stage alone with its input whole (the same config with full payload edges, in process).",
            _run_speech,
        ),
        (
            "scale",
            "throughput and latency with 1, 2, 4 replicas of the DiT (issue 41)",
            "Run the AR -> DiT pipeline with its DiT at each --replicas count, in process, closed loop at "
            "--concurrency; print throughput and p50/p99 latency, each as a ratio to a ceiling measured in "
            "the same run (linear scaling of the smallest count, N x the DiT alone, the unloaded latency) "
            "and which replica served how many requests. --modes stand-in also runs it with a DiT whose "
            "every denoise step waits --step-ms per request: a stand-in for GPU time, labelled as such.",
            _run_scale,
        ),
        (
            "all",
            "every bench, one table of ratios to same-run ceilings",
            "Run the connectors, handoff, kv-path, serve, speech and scale benches in one go and print one "
            "row per figure: its value (a ratio to a ceiling measured in the same run, or ms), spread over "
            "the repeats, goal, whether it is met and the ceiling. A figure whose engine cannot run here is "
            "'not run' with its reason; the exit code is 1 only when every figure failed.",
            _run_all,
        ),
    )
    for name, help_, description, runner in benches:
        sub = bench_sub.add_parser(name, help=help_, description=description)
        importlib.import_module(f"vllm_kvbridge.bench.{name.replace('-', '_')}").add_arguments(sub)
        sub.set_defaults(func=runner)


def _run_connectors(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.connectors import format_table, parse_size, run_connector_bench, write_json

    try:
        connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        if not connectors or not sizes or args.repeat < 1:
            raise ValueError("need at least one connector, one size and --repeat >= 1")
    except ValueError as exc:
        raise SystemExit(f"vllm-kvbridge bench connectors: {exc}") from None
    rows = run_connector_bench(connectors, sizes, args.repeat)
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json)
    return 0


def _report(name: str, args: argparse.Namespace, run: Any, fmt: Any, write: Any) -> Any:
    """Run a bench (a ValueError is a usage error), print its table, write its JSON."""
    try:
        result = run(args)
    except ValueError as exc:
        raise SystemExit(f"vllm-kvbridge bench {name}: {exc}") from None
    print(fmt(result))
    if args.json:
        write(result, args.json)
    return result


def _run_ar_overhead(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.ar_overhead import format_result, run, write_json

    _report("ar-overhead", args, run, format_result, write_json)
    return 0


def _run_kv_path(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.kv_path import format_result, parse_connectors, parse_tokens, run, write_json

    def checked_run(args: argparse.Namespace) -> dict[str, Any]:
        parse_tokens(args.tokens)
        parse_connectors(args.connectors)
        if args.repeat < 1:
            raise ValueError("--repeat must be >= 1")
        return run(args)

    result = _report("kv-path", args, checked_run, format_result, write_json)
    return 1 if result["failed"] else 0


def _run_handoff(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.handoff import format_table, run, write_json

    _report("handoff", args, run, format_table, write_json)
    return 0


def _run_gpu_path(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.gpu_path import format_result, run, write_json

    _report("gpu-path", args, run, format_result, write_json)
    return 0


def _run_speech(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.speech import format_result, run, write_json

    _report("speech", args, run, format_result, write_json)
    return 0


def _run_scale(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.scale import format_result, run, write_json

    _report("scale", args, run, format_result, write_json)
    return 0


def _run_all(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.all import format_result, run, write_json

    result = _report("all", args, run, format_result, write_json)
    return 1 if result.all_failed else 0


def _run_soak(args: argparse.Namespace) -> int:
    from vllm_kvbridge.bench.soak import format_result, run, write_json

    result = run(args)
    print(format_result(result))
    if args.json:
        write_json(result, args.json)
    return 0
