"""``vllm-kvbridge run``: run a pipeline end to end and write its outputs.

    vllm-kvbridge run --stage-config FILE --prompt TEXT [--prompt ...] [--model DIR | --arch ARCH]
                      [--output-dir DIR] [--start-mooncake-master]

``--arch qwen3`` runs LLM stages that name no model on the tiny offline model of that
architecture (``kvbridge://tiny-qwen3``); the default is the tiny Llama. A diffusion stage
fed KV takes its KV geometry from that model (``config/kv_geometry.py``).

Prints one progress line per stage event and a final table (per stage wall time; per
edge bytes moved, transfer seconds, GB/s, the receiver's whole wait and the handoff from the
producer's last token to the payload in the consumer), and writes into the output dir: one PNG per
request for pipelines ending in a diffusion stage, one ``.txt`` per request for those
ending in an LLM stage, the stage logs, and ``result.json``. Exit status: 0 when every
request succeeded, 1 when a request failed, 2 for a bad config, 3 when a stage failed
(its error is printed), 130 on Ctrl-C.

``--start-mooncake-master`` starts a ``mooncake_master`` (with its HTTP metadata server) on
free loopback ports for this run, points every ``MooncakeStoreConnector`` of the config at
it, and stops it at the end after printing how many keys were left in the store (its log
goes with the stage logs). A one-host convenience; several hosts share a master started by
hand (``docs/multi_host.md``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.models.model_args import add_model_arguments, chosen_model, describe_tiny, tiny_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run", help="run a pipeline from a stage config", description="Run a multi-stage pipeline end to end."
    )
    p.add_argument("--stage-config", required=True, help="stage config YAML (see stage_configs/)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    add_model_arguments(p)
    p.add_argument("--output-dir", default="kvbridge-output", help="where outputs go (default: %(default)s)")
    p.add_argument(
        "--ray-address",
        help="run the stages on this Ray cluster (auto | HOST:PORT): one actor per stage, placed by"
        " stages[].placement (default: the config's runtime.ray_address, else local processes)",
    )
    p.add_argument("--max-tokens", type=int, help="override the first stage's max_tokens")
    p.add_argument("--debug-dump-dir", help="dump what receiving stages consumed (KV caches) here")
    p.add_argument(
        "--start-mooncake-master",
        action="store_true",
        help="start a local mooncake_master on free loopback ports for this run and point every "
        "MooncakeStoreConnector of the config at it (stopped at the end)",
    )
    p.set_defaults(func=_run)


# -- output -----------------------------------------------------------------------------
def _safe_name(rid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", rid)[:64]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


EDGE_NOTE = (
    "transfer s: the receiver's gets (KV: its wait); waited s: from the receiver expecting it to "
    "the last piece, a stream's producer generating included; handoff ms: from the producer's "
    "last token to the payload complete in the consumer (mean)"
)


def summary_table(results: list[Any], plan: Any) -> str:
    """Per stage wall time (mean over requests) and per edge bytes, transfer and wait seconds
    and GB/s (totals), and the stage-to-stage handoff (mean)."""
    lines = [f"{'stage':<24}{'requests':>9}{'mean wall s':>13}"]
    for s in plan.stages:
        walls = [rec.wall_s for r in results for rec in r.stages if rec.stage_id == s.stage_id and rec.done]
        mean = sum(walls) / len(walls) if walls else 0.0
        lines.append(f"{f'{s.stage_id} ({s.kind})':<24}{len(walls):>9}{mean:>13.3f}")
        for k in range(s.replicas if s.replicas > 1 else 0):  # how the requests were spread
            served = [
                rec.wall_s
                for r in results
                for rec in r.stages
                if rec.stage_id == s.stage_id and rec.done and rec.replica == k
            ]
            mean = sum(served) / len(served) if served else 0.0
            lines.append(f"{f'  replica {k}':<24}{len(served):>9}{mean:>13.3f}")
    edges: dict[tuple[int, int, str, str], list[float]] = {}
    handoffs: dict[tuple[int, int], list[float]] = {}
    for r in results:
        for key, t in r.edge_stats().items():
            acc = edges.setdefault(key, [0.0, 0.0, 0.0])
            acc[0] += t.nbytes
            acc[1] += t.seconds
            acc[2] += t.waited_s
            handoff = r.handoff_s(key[0], key[1])
            if handoff is not None and key[3] == "kv":
                handoffs.setdefault(key[:2], []).append(handoff)
    lines.append("")
    lines.append(f"{'edge':<24}{'bytes':>12}{'transfer s':>12}{'GB/s':>9}{'waited s':>10}{'handoff ms':>12}")
    if not edges:
        lines.append("(no transfer reported)")
    for (a, b, what, purpose), (nbytes, secs, waited) in sorted(edges.items()):
        rate = f"{nbytes / secs / 1e9:.3f}" if secs > 0 else "-"
        label = what if purpose == "kv" else f"{what} {purpose}"  # a CFG companion's KV
        waits = f"{waited:.4f}" if waited > 0 else "-"
        got = handoffs.get((a, b)) if purpose == "kv" else None
        handoff = f"{sum(got) / len(got) * 1e3:.1f}" if got else "-"
        name = f"{a} -> {b} {label}"
        lines.append(f"{name:<24}{_fmt_bytes(nbytes):>12}{secs:>12.4f}{rate:>9}{waits:>10}{handoff:>12}")
    if edges:
        lines.append(f"({EDGE_NOTE})")
    for s in plan.stages:  # which connector each edge used, and why where it was picked
        for e in s.outputs:
            why = f" ({e.connector.reason})" if e.connector.reason else ""
            lines.append(f"edge {e.from_stage} -> {e.to_stage}: {e.connector.name}{why}")
    for x in plan.links:  # replicas: each pair's own
        if plan.stage(x.from_stage).replicas > 1 or plan.stage(x.to_stage).replicas > 1:
            pair = f"{x.from_stage} -> {x.to_stage} replica {x.from_replica} -> {x.to_replica}"
            lines.append(f"edge {pair}: {x.connector.name} ({x.connector.reason})")
    return "\n".join(lines)


def write_outputs(
    results: list[Any], plan: Any, out_dir: Path, started: float, run_id: str | None = None
) -> dict[str, Any]:
    # lazy: the pipeline package is heavy
    from vllm_kvbridge.pipeline.audio import encode_wav
    from vllm_kvbridge.pipeline.images import encode_png

    out_dir.mkdir(parents=True, exist_ok=True)
    # The connector each edge used (an auto edge's: the one its placement picked, per pair
    # of replicas where a stage has several: the request's own pair's).
    connectors = {(e.from_stage, e.to_stage): e.connector.name for s in plan.stages for e in s.outputs}

    def connector(r: Any, a: int, b: int) -> str | None:
        replica = {x.stage_id: x.replica for x in r.stages}
        link = plan.link(a, b, replica.get(a, 0), replica.get(b, 0))
        return link.connector.name if link is not None else connectors.get((a, b))

    records = []
    for r in results:
        paths = []
        if r.image is not None:
            path = out_dir / f"{_safe_name(r.request_id)}.png"
            path.write_bytes(encode_png(r.image))
            paths.append(str(path))
        if r.audio is not None:
            path = out_dir / f"{_safe_name(r.request_id)}.wav"
            path.write_bytes(encode_wav(r.audio, r.sample_rate))
            paths.append(str(path))
        if r.text is not None:
            path = out_dir / f"{_safe_name(r.request_id)}.txt"
            path.write_text(r.text)
            paths.append(str(path))
        records.append(
            {
                "request_id": r.request_id,
                "prompt": r.prompt,
                "error": r.error,
                "text": r.text,
                "token_ids": r.token_ids,
                "image_shape": list(r.image.shape) if r.image is not None else None,
                "audio": None
                if r.audio is None
                else {"num_samples": len(r.audio), "sample_rate": r.sample_rate},
                "outputs": paths,
                "stages": [
                    {
                        "stage_id": s.stage_id,
                        "kind": s.kind,
                        "node_id": s.node_id,
                        # which replica of the stage served it (stages[].replicas; 0 without)
                        "replica": s.replica,
                        "wall_s": round(s.wall_s, 6),
                        "stage_s": round(max(0.0, s.finished - s.started), 6) if s.finished else None,
                        # wall-clock seconds (time.time()), one clock for the stages of a host
                        "first_token_at": (s.first_token_at or s.finished) or None,
                        "last_token_at": (s.last_token_at or s.finished) or None,
                        # an LLM stage's generated tokens (a talker's codes a vocoder read)
                        **({"token_ids": s.output["token_ids"]} if "token_ids" in s.output else {}),
                        # a vocoder's: the chunks it vocoded, each as it landed, and when its
                        # first audio was made (its first_token_at, named for what it is)
                        **(
                            {"chunks": s.output.get("chunks"), "first_audio_at": s.first_token_at or None}
                            if s.kind == "vocoder"
                            else {}
                        ),
                    }
                    for s in r.stages
                ],
                # every transfer of the request, CFG companions' KV included (their purpose)
                # seconds: the transfer (the receiver's gets; KV: its wait); waited_s: the
                # receiver's whole wait; ready_at: time.time() when it held the payload
                "transfers": [
                    {
                        "from_stage": a,
                        "to_stage": b,
                        "what": what,
                        "purpose": purpose,
                        "connector": connector(r, a, b),
                        "bytes": t.nbytes,
                        "seconds": round(t.seconds, 6),
                        "waited_s": round(t.waited_s, 6),
                        "ready_at": t.ready_at or None,
                    }
                    for (a, b, what, purpose), t in sorted(r.edge_stats().items())
                ],
            }
        )
    result = {
        "pipeline": plan.name,
        "source": plan.source,
        # the run's namespace: its shared-memory segments are named kvbridge.<run_id>...
        "run_id": run_id,
        "total_s": round(time.time() - started, 3),
        "requests": records,
    }
    (out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


# -- --start-mooncake-master ------------------------------------------------------------
MOONCAKE = "MooncakeStoreConnector"


def uses_mooncake(plan: Any) -> bool:
    return any(e.connector.name == MOONCAKE for s in plan.stages for e in (*s.inputs, *s.outputs))


def use_mooncake_master(plan: Any, master_address: str, metadata_server: str) -> Any:
    """A copy of ``plan`` whose Mooncake connectors use this master and metadata server."""
    import msgspec

    def point(edge: Any) -> Any:
        if edge.connector.name != MOONCAKE:
            return edge
        config = {**edge.connector.config, "master_server_address": master_address}
        config["metadata_server"] = metadata_server
        return msgspec.structs.replace(edge, connector=msgspec.structs.replace(edge.connector, config=config))

    stages = [
        msgspec.structs.replace(s, inputs=[point(e) for e in s.inputs], outputs=[point(e) for e in s.outputs])
        for s in plan.stages
    ]
    return msgspec.structs.replace(plan, stages=stages)


def _run(args: argparse.Namespace) -> int:
    from vllm_kvbridge.config.resolve import resolve

    try:
        plan = _with_default_model(args, resolve(args.stage_config))
        if args.start_mooncake_master and not uses_mooncake(plan):
            raise ConfigError(f"--start-mooncake-master: the config uses no {MOONCAKE}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.start_mooncake_master:
        return _run_plan(args, plan)
    from vllm_kvbridge.connectors.mooncake_master import MooncakeMaster

    master = MooncakeMaster(log_dir=Path(args.output_dir) / "logs")
    try:
        master.start()
    except (OSError, RuntimeError) as exc:
        print(f"error: --start-mooncake-master: {exc}", file=sys.stderr)
        master.stop()
        return 3
    print(
        f"mooncake_master: {master.master_address}, metadata {master.metadata_server} "
        f"(pid {master.pid}, log {master.log_path})",
        flush=True,
    )
    try:
        return _run_plan(args, use_mooncake_master(plan, master.master_address, master.metadata_server))
    finally:
        try:
            left = len(master.keys())
        except OSError as exc:
            left = f"unknown ({exc})"
        master.stop()
        print(f"mooncake_master: stopped, {left} keys left in the store", flush=True)


def _with_default_model(args: argparse.Namespace, plan: Any) -> Any:
    """``plan`` with ``--model`` / ``--arch`` (else the tiny Llama) for LLM stages that name
    none; resolved before anything starts, so a diffusion stage's KV geometry that the model
    contradicts is a config error (exit 2)."""
    if not any(s.is_llm and not s.model for s in plan.stages):
        if args.model or args.arch:
            print("note: every LLM stage names its model; --model / --arch is not used", flush=True)
        return plan
    model = chosen_model(args)
    if model is None or args.arch:
        model = model or tiny_model(None)
        print(describe_tiny(args.arch, model), flush=True)
    return plan.with_model(model)


def _run_plan(args: argparse.Namespace, plan: Any) -> int:
    from vllm_kvbridge.pipeline.orchestrator import Pipeline, PipelineError, RequestError, StageError

    started = time.time()
    if args.debug_dump_dir:
        import msgspec

        dump = str(Path(args.debug_dump_dir).resolve())
        plan = msgspec.structs.replace(
            plan,
            debug_dump_dir=dump,
            stages=[msgspec.structs.replace(s, debug_dump_dir=dump) for s in plan.stages],
        )
    out_dir = Path(args.output_dir)
    params = {"max_tokens": args.max_tokens} if args.max_tokens else None

    def progress(line: str) -> None:
        print(line, flush=True)

    pipe = Pipeline(plan, log_dir=out_dir / "logs", progress=progress, ray_address=args.ray_address)
    results = None
    code = 0
    try:
        with pipe:
            try:
                results = pipe.generate(args.prompt, params)
            except RequestError as exc:
                results, code = exc.results, 1
                print(f"error: {exc}", file=sys.stderr)
    except StageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if exc.log_tail:
            print(f"--- stage {exc.stage_id} ---\n{exc.log_tail}", file=sys.stderr)
        return 3
    except PipelineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted: every stage stopped", file=sys.stderr)
        return 130
    result = write_outputs(results, pipe.plan, out_dir, started, pipe.run_id)
    print()
    print(summary_table(results, pipe.plan))
    print()
    for rec in result["requests"]:
        status = f"FAILED: {rec['error']}" if rec["error"] else ", ".join(rec["outputs"]) or "(no output)"
        print(f"{rec['request_id']}: {rec['prompt']!r} -> {status}")
    print(f"wrote {out_dir / 'result.json'} (total {result['total_s']:.1f} s)")
    return code
