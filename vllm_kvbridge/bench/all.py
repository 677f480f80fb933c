"""``vllm-kvbridge bench all``: every bench, one table of ratios to same-run ceilings.

Why: the project's performance claims (issue 37) are spread over four benches, each with
its own table and its own ceiling. This runs them in one go and prints one row per
figure: its value (a ratio to a ceiling measured in this same run, or a latency in ms),
the spread over the repeats where the bench gives one, the goal, whether it is met and
what the ceiling was. Nothing is re-measured here: each figure is read from the bench
that owns it, run with its own defaults (its namespace is parsed through its own
``add_arguments``), so the two never disagree.

Figure groups (``--only``): ``connectors`` (one :func:`~vllm_kvbridge.bench.connectors.run_connector_bench`
call for every connector at ``--size``), ``handoff`` (1 KB over shared memory),
``kv-path`` (a vLLM engine's KV to a receiver, 2k and 8k tokens: starts an engine),
``serve`` (``bench soak`` at concurrency 8 without aborts on the shipped image config:
starts a server), ``speech`` (``bench speech`` at concurrency 1 and 8, its own defaults
but ``--repeat``: the streaming speech pipeline's first packet, goal 1.3x its stages alone
(issue 40), and its real-time factors, goal 0.8x their ceilings as the other ratios; starts
a pipeline and a server) and ``scale`` (``bench scale --modes stand-in --replicas 1,4``,
its own defaults but ``--repeat``: throughput of 4 DiT replicas over 1 at concurrency 8
with the stand-in DiT whose denoise steps wait a fixed time, goal 3.5x (issue 41); starts
two pipelines). An engine that cannot run here (Mooncake or NIXL not installed, a bench
that raises) gives "not run" rows with the reason; the others still run. ``--repeat`` goes
to every bench but the handoff as is (3 by default, to keep the whole run to minutes); the
handoff keeps its own 200 (a 1 KB handoff takes about a millisecond); its spread column
shows the p99.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GROUPS = ("connectors", "handoff", "kv-path", "serve", "speech", "scale")
#: Connectors of the ``connectors`` group, in the order they are measured (registry aliases).
CONNECTORS = ("shm", "zmq", "mooncake", "mooncake-te", "nixl")
DEFAULT_STAGE_CONFIG = "stage_configs/ar_to_dit_shm.yaml"
HEADER = (
    "bench all: each value is a ratio to a ceiling measured in this same run (or a latency, "
    "with its bare transport's); spread is min-max over the repeats"
)


@dataclass
class Figure:
    """One row of the table: a figure, its goal, and its value (None: not run, see ``reason``)."""

    group: str
    figure: str
    goal_op: str  # ">=" or "<="
    goal_value: float
    unit: str  # "x" (a ratio) or "ms"
    goal_note: str = ""
    value: float | None = None
    spread: str = "-"
    spread_min: float | None = None
    spread_max: float | None = None
    ceiling: str = ""
    reason: str = "not measured"

    @property
    def goal(self) -> str:
        unit = "x" if self.unit == "x" else " ms"
        return f"{self.goal_op} {self.goal_value:g}{unit}" + (f" {self.goal_note}" if self.goal_note else "")

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.goal_value if self.goal_op == ">=" else self.value <= self.goal_value

    def measured(
        self, value: float, ceiling: str, lo: float | None = None, hi: float | None = None, spread: str = ""
    ) -> None:
        """Record a value (a non-finite or non-positive one leaves the row "not run")."""
        if not (math.isfinite(value) and value > 0):
            self.reason = f"the bench gave no usable value ({value})"
            return
        self.value, self.ceiling, self.reason = value, ceiling, ""
        if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
            self.spread_min, self.spread_max = lo, hi
            self.spread = f"{lo:.2f}-{hi:.2f}"
        elif spread:
            self.spread = spread

    def failed(self, reason: str) -> None:
        self.value, self.reason = None, reason


@dataclass
class AllResult:
    figures: list[Figure]
    repeat: int
    size: int
    #: each bench's own result, as its own ``--json`` holds it
    benches: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def all_failed(self) -> bool:
        return all(f.value is None for f in self.figures)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--only",
        default=",".join(GROUPS),
        metavar="LIST",
        help=f"comma-separated figure groups, of {', '.join(GROUPS)} (default: all)",
    )
    p.add_argument("--repeat", type=int, default=3, help="repeats passed to every bench (default 3)")
    p.add_argument("--size", default="64MB", help="payload of the connectors group (default 64MB)")
    p.add_argument("--requests", type=int, default=48, help="serve: requests at concurrency 8 (default 48)")
    p.add_argument(
        "--stage-config",
        default=DEFAULT_STAGE_CONFIG,
        help=f"serve: the config `serve` is started with (default {DEFAULT_STAGE_CONFIG})",
    )
    p.add_argument("--json", metavar="OUT", help="also write the figures and each bench's result to OUT")


def parse_only(text: str) -> list[str]:
    groups = [g.strip() for g in text.split(",") if g.strip()]
    bad = [g for g in groups if g not in GROUPS]
    if not groups or bad:
        raise ValueError(f"--only: choose from {', '.join(GROUPS)}, got {text!r}")
    return [g for g in GROUPS if g in groups]


def size_label(nbytes: int) -> str:
    """67108864 -> ``"64 MB"`` (binary units, as the benches parse them)."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _namespace(add: Callable[[argparse.ArgumentParser], None], argv: list[str]) -> argparse.Namespace:
    """A bench's arguments as its own command line parses them (its defaults stay its own)."""
    p = argparse.ArgumentParser(add_help=False)
    add(p)
    return p.parse_args(argv)


def _gbps(value: float, lo: float = math.nan, hi: float = math.nan) -> str:
    spread = f" ({lo:.2f}-{hi:.2f})" if math.isfinite(lo) and math.isfinite(hi) else ""
    return f"{value:.2f} GB/s{spread}"


# -- the groups -------------------------------------------------------------------------
def _connectors(args: argparse.Namespace, res: AllResult, out: list[Figure]) -> None:
    from vllm_kvbridge.bench.connectors import connector_unavailable, run_connector_bench

    label = size_label(args.size)
    figs = {
        "mooncake": Figure(
            "connectors", f"Mooncake store vs Mooncake's own put/get, {label}", ">=", 0.9, "x"
        ),
        "nixl": Figure("connectors", f"NIXL connector vs NIXL agent write+READ, {label}", ">=", 0.9, "x"),
        "nixl-get": Figure("connectors", f"NIXL get vs NIXL READ, {label}", ">=", 0.9, "x"),
        "mooncake-te": Figure("connectors", f"Mooncake TE vs raw TE write+read, {label}", ">=", 0.9, "x"),
        "mooncake-te-get": Figure("connectors", f"Mooncake TE get vs raw TE read, {label}", ">=", 0.9, "x"),
        "shm": Figure("connectors", f"SHM vs memcpy, {label}", ">=", 0.9, "x"),
        "zmq": Figure("connectors", f"ZMQ vs bare pyzmq, {label}", ">=", 0.9, "x"),
    }
    out += figs.values()
    skipped = {n: why for n in CONNECTORS if (why := connector_unavailable(n))}
    names = [n for n in CONNECTORS if n not in skipped]
    rows: list[Any] = []
    if names:
        try:
            rows = run_connector_bench(names, [args.size], args.repeat)
        except Exception as exc:  # which one broke is not said: measure each alone
            _progress(f"connectors: one run of all failed ({one_line(exc)}); measuring each alone")
            for n in names:
                try:
                    rows += run_connector_bench([n], [args.size], args.repeat)
                except Exception as exc_n:
                    skipped[n] = one_line(exc_n)
    res.benches["connectors"] = [asdict(r) for r in rows]
    for name, why in skipped.items():
        figs[name].failed(why)
        if name in ("nixl", "mooncake-te"):
            figs[f"{name}-get"].failed(why)
    for r in rows:
        c = r.ceiling_gbps
        lo, hi = r.gbps_min / c, r.gbps_max / c
        ceil = _gbps(c, r.ceiling_min_gbps, r.ceiling_max_gbps)
        if r.connector == "shm":
            m = r.memcpy_gbps
            figs["shm"].measured(r.ratio, f"memcpy {_gbps(m)}", r.gbps_min / m, r.gbps_max / m)
        elif r.connector == "zmq":
            figs["zmq"].measured(r.ceiling_ratio, f"bare pyzmq {ceil}", lo, hi)
        elif r.connector == "mooncake":
            figs["mooncake"].measured(r.ceiling_ratio, f"Mooncake put+get {ceil}", lo, hi)
        elif r.connector in ("mooncake-te", "nixl"):
            what = "raw TE write+read" if r.connector == "mooncake-te" else "NIXL write+READ"
            figs[r.connector].measured(r.ceiling_ratio, f"{what} {ceil}", lo, hi)
            # the get against the engine's read alone (the probe keeps both)
            read = r.bytes / (r.get_ratio * r.get_s) / 1e9 if r.get_ratio > 0 else math.nan
            what = "raw TE read" if r.connector == "mooncake-te" else "NIXL READ"
            figs[f"{r.connector}-get"].measured(r.get_ratio, f"{what} {_gbps(read)}")


def _handoff(args: argparse.Namespace, res: AllResult, out: list[Figure]) -> None:
    from vllm_kvbridge.bench import handoff

    paths = {"stage": "stage path", "get": "Connector.get"}
    figs = {
        p: Figure("handoff", f"1 KB handoff p50, SHM ({what})", "<=", 1.0, "ms") for p, what in paths.items()
    }
    out += figs.values()
    # Its own --repeat (200): a 1 KB handoff takes about a millisecond, and a p50 of 3 is noise.
    ns = _namespace(handoff.add_arguments, ["--connectors", "shm", "--sizes", "1KB"])
    rows = handoff.run(ns)
    res.benches["handoff"] = [asdict(r) for r in rows]
    for r in rows:
        if r.path in figs:
            ceiling = f"bare shm p50 {r.ceiling_p50_ms:.3f} ms (value = {r.ratio:.1f}x it)"
            figs[r.path].measured(r.p50_ms, ceiling, spread=f"p99 {r.p99_ms:.3f}")


def _kv_path(args: argparse.Namespace, res: AllResult, out: list[Figure]) -> None:
    from vllm_kvbridge.bench import kv_path

    tokens = {2048: "2k", 8192: "8k"}
    figs = {
        t: Figure(
            "kv-path",
            f"engine path (vLLM cache -> receiver), SHM, {k} tokens",
            ">=",
            0.8,
            "x",
            goal_note="the layout's gather",
        )
        for t, k in tokens.items()
    }
    out += figs.values()
    argv = ["--connectors", "shm", "--tokens", ",".join(map(str, tokens)), "--repeat", str(args.repeat)]
    result = kv_path.run(_namespace(kv_path.add_arguments, argv))
    res.benches["kv-path"] = result
    why = result["skipped"].get("shm") or result.get("failed", {}).get("shm")
    for t, fig in figs.items():
        fig.failed(why or f"kv-path gave no row for {t} tokens")
    for row in result["rows"]:
        fig = figs.get(row["tokens"]) if row["connector"] == "shm" else None
        if fig is not None:
            g = row["gather_gbps"]
            ceiling = f"gather {_gbps(g)}, memcpy {row['memcpy_gbps']:.2f}"
            fig.measured(row["gather_ratio"], ceiling, row["gbps_min"] / g, row["gbps_max"] / g)


def _serve(args: argparse.Namespace, res: AllResult, out: list[Figure]) -> None:
    """Closed-loop load at concurrency 1, then 8, on one server (``bench soak --url`` twice):
    the ratio of the two throughputs. Not soak's own ratio to ``1 / unloaded latency``: its
    few unloaded requests include the server's first ones, whose spread (0.25-1.6 s seen)
    moved that ratio more than the load did."""
    import tempfile

    from vllm_kvbridge.bench import soak
    from vllm_kvbridge.bench.dit_alone import describe, measure_dit_alone

    fig = Figure("serve", "image throughput through serve, concurrency 8 vs 1", ">=", 3.0, "x")
    out.append(fig)
    config = Path(args.stage_config)
    if not config.exists() and not config.is_absolute():  # the shipped one, from anywhere
        config = Path(__file__).resolve().parents[2] / config
    # The DiT alone first, on a quiet machine: what batching could give with nothing in front.
    alone = measure_dit_alone(config)
    log = Path(tempfile.mkdtemp(prefix="kvbridge-bench-all-")) / "serve.log"
    server = soak._Server(str(config), None, log)
    try:
        server.wait_ready()
        runs = {}
        for concurrency, requests in ((1, max(8, args.requests // 3)), (8, args.requests)):
            argv = ["--url", server.url, "--concurrency", str(concurrency), "--abort-frac", "0"]
            argv += ["--requests", str(requests), "--baseline", "2"]  # the baseline warms up
            runs[concurrency] = soak.run(_namespace(soak.add_arguments, argv))
    finally:
        server.stop()
    res.benches["serve"] = {f"c{c}": {**asdict(r), "throughput": r.throughput} for c, r in runs.items()}
    res.benches["serve"]["dit_alone"] = describe(alone)
    one, eight = runs[1], runs[8]
    if not (one.ok and eight.ok):
        fig.failed(f"no throughput: ok {one.ok}/{one.requests} at c=1, {eight.ok}/{eight.requests} at c=8")
        return
    ceiling = (
        f"c=1 {one.throughput:.2f}/s (p50 {one.p50_s:.2f} s); c=8 p50 {eight.p50_s:.2f} s; DiT alone "
        f"{alone.single_per_s:.0f}/s, batch {alone.batch} {alone.batched_per_s:.0f}/s ({alone.speedup:.1f}x)"
    )
    if one.ok < one.requests or eight.ok < eight.requests:
        ceiling += f"; only {one.ok}/{one.requests} and {eight.ok}/{eight.requests} ok"
    fig.measured(eight.throughput / one.throughput, ceiling)


def _speech(args: argparse.Namespace, res: AllResult, out: list[Figure]) -> None:
    """``bench speech``: first packet at c=1 against the stages alone (goal of issue 40:
    1.3x), and both real-time factors' share of their ceilings (goal: 0.8x)."""
    from vllm_kvbridge.bench import speech

    figs = {
        ("first_packet_s", 1): Figure(
            "speech", "speech first packet p50, c=1, vs stages alone", "<=", 1.3, "x"
        ),
        ("rtf", 1): Figure("speech", "speech RTF per request p50, c=1, vs stages alone", ">=", 0.8, "x"),
        ("aggregate_rtf", 8): Figure("speech", "speech RTF aggregate, c=8, vs stages alone", ">=", 0.8, "x"),
    }
    out += figs.values()
    result = speech.run(_namespace(speech.add_arguments, ["--repeats", str(args.repeat)]))
    res.benches["speech"] = result
    levels = {lv["concurrency"]: lv for lv in result["levels"]}
    for (key, c), fig in figs.items():
        f = levels[c][key]
        unit = " s" if key == "first_packet_s" else ""
        ceiling = f"value {f['value']:.3f}{unit}, ceiling {f['ceiling']:.3f}{unit}"
        fig.measured(f["ratio"], ceiling, f["ratio_min"], f["ratio_max"])


def _scale(args: argparse.Namespace, res: AllResult, out: list[Figure]) -> None:
    """``bench scale`` with the stand-in DiT (a fixed wait per denoise step, standing in
    for GPU time): throughput of 4 DiT replicas over 1 at concurrency 8 (goal of issue 41:
    3.5x), the spread the widest the repeats allow."""
    from vllm_kvbridge.bench import scale

    fig = Figure("scale", "4 DiT replicas vs 1, c=8, stand-in denoise (GPU time)", ">=", 3.5, "x")
    out.append(fig)
    argv = ["--modes", "stand-in", "--replicas", "1,4", "--repeats", str(args.repeat)]
    result = scale.run(_namespace(scale.add_arguments, argv))
    res.benches["scale"] = result
    mode = result["modes"]["stand-in"]
    one, four = mode["rows"]
    s = four["speedup"]
    ceiling = (
        f"1 replica {one['throughput']['value']:.2f}/s, 4: {four['throughput']['value']:.2f}/s; "
        f"{four['of_dit_alone']:.2f}x of 4 x the DiT alone; {mode['label']}"
    )
    if one["failed"] or four["failed"]:
        ceiling += f"; failed: {one['failed']} and {four['failed']}"
    fig.measured(s["value"], ceiling, s["min"], s["max"])


#: Each fills ``out`` with its figures ("not measured") before its bench runs, then sets them.
_RUNNERS: dict[str, Callable[[argparse.Namespace, AllResult, list[Figure]], None]] = {
    "connectors": _connectors,
    "handoff": _handoff,
    "kv-path": _kv_path,
    "serve": _serve,
    "speech": _speech,
    "scale": _scale,
}


def _progress(text: str) -> None:
    print(f"bench all: {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> AllResult:
    """Run the chosen groups; ValueError on bad arguments (before anything runs)."""
    from vllm_kvbridge.bench.connectors import parse_size

    groups = parse_only(args.only)
    if args.repeat < 1 or args.requests < 1:
        raise ValueError("need --repeat >= 1 and --requests >= 1")
    size = parse_size(args.size) if isinstance(args.size, str) else int(args.size)
    ns = argparse.Namespace(**{**vars(args), "size": size})
    res = AllResult([], args.repeat, size)
    for group in groups:
        _progress(f"running {group}")
        start = time.monotonic()
        figs: list[Figure] = []
        try:
            _RUNNERS[group](ns, res, figs)
        except (Exception, SystemExit) as exc:  # soak exits on a server that never came up
            for fig in figs:
                if fig.value is None:
                    fig.failed(f"the {group} bench failed: {one_line(exc)}")
        res.seconds[group] = round(time.monotonic() - start, 1)
        res.figures += figs
    return res


def format_result(r: AllResult) -> str:
    def value(f: Figure) -> str:
        if f.value is None:
            return "not run"
        return f"{f.value:.2f}x" if f.unit == "x" else f"{f.value:.3f} ms"

    met = {True: "yes", False: "no", None: "-"}
    width = max([len("figure"), *(len(f.figure) for f in r.figures)])
    gw = max([len("goal"), *(len(f.goal) for f in r.figures)])
    header = f"{'figure':<{width}}  {'value':>9}  {'goal':<{gw}}  {'met':<3}  {'spread':<13}  ceiling"
    lines = [HEADER + f" ({r.repeat} each; connectors at {size_label(r.size)}).", header, "-" * len(header)]
    for f in r.figures:
        last = f.ceiling if f.value is not None else f"reason: {f.reason}"
        lines.append(
            f"{f.figure:<{width}}  {value(f):>9}  {f.goal:<{gw}}  {met[f.met]:<3}  {f.spread:<13}  {last}"
        )
    ran = ", ".join(f"{g} {s:.0f} s" for g, s in r.seconds.items())
    lines.append(f"ran: {ran}")
    return "\n".join(lines)


def _finite(obj: Any) -> Any:
    """NaN / inf as null, so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def figure_dict(f: Figure) -> dict[str, Any]:
    return {**asdict(f), "goal": f.goal, "met": f.met}


def write_json(r: AllResult, path: str) -> None:
    data = {
        "note": HEADER,
        "repeat": r.repeat,
        "size": r.size,
        "seconds": r.seconds,
        "figures": [figure_dict(f) for f in r.figures],
        "benches": r.benches,
    }
    Path(path).write_text(json.dumps(_finite(data), indent=2) + "\n")


__all__ = [
    "AllResult",
    "Figure",
    "add_arguments",
    "format_result",
    "run",
    "write_json",
]
