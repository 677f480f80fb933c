"""``vllm-kvbridge bench speech``: the streaming speech pipeline's serving figures.

Starts ``vllm-kvbridge serve`` on the shipped ``stage_configs/thinker_talker_vocoder.yaml``
(thinker streams hidden states -> talker fed per step streams its codes -> vocoder makes
audio per chunk; the tiny local models, or ``--model`` / ``--arch`` for the thinker;
shared memory) and drives ``POST /v1/audio/speech`` with ``stream_format: sse`` from real
HTTP clients (httpx, one connection per client thread), ``--requests`` requests per
concurrency level (``--concurrency``, closed loop), ``--repeats`` times. Per request the
client records, on its own clock (``time.perf_counter``):

* first packet: the request sent -> the first ``speech.audio.delta`` event holding audio
  decoded at the client;
* total: the request sent -> ``speech.audio.done``;
* audio seconds: the PCM samples received / the vocoder's sample rate (and the codes the
  server vocoded, ``usage.output_tokens``: samples = codes x the vocoder's hop length);
* real-time factor (RTF): audio seconds / total seconds per request, and in aggregate
  all the requests' audio seconds / the wall time of the load.

The ceilings, measured in the same run, before the server starts, on the same prompts
and models: each stage run alone with its input already whole
(:mod:`vllm_kvbridge.bench.speech_alone`: the same config with ``full`` payload edges, in
process, real engines). First packet's ceiling: thinker's time to its first chunk + the
talker's time to its first code chunk + the vocoder's time to its first audio. RTF's:
a request's audio seconds / (that first-packet ceiling + the codes after the first chunk
x the slowest stage's time per code alone), per request, and x concurrency in aggregate.
Each figure is printed with its ratio to its ceiling (value / ceiling: at best 1; over 1
for the first packet and under 1 for the RTFs is what the serving path costs), pooled
p50 / p99 / min / max over the repeats, and the ratio's min-max over the repeats. Nothing
is gated on time.

The ceilings run first, then the server (never both: "alone" means nothing else of the
bench runs), so a load that changes between the two (other work on the host) moves the ratios:
a first-packet ratio under 1 or an RTF ratio over 1 says the host was busier while the
ceiling was measured. The RTF ceiling's pace per code comes from the talker's first chunk
alone (``chunk_size`` codes): an estimate, where the first packet's ceiling is measured.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from vllm_kvbridge.bench.handoff import percentile
from vllm_kvbridge.bench.speech_alone import StagesAlone, measure_stages_alone
from vllm_kvbridge.models.model_args import add_model_arguments, chosen_model, tiny_model

CONFIG = "stage_configs/thinker_talker_vocoder.yaml"
ROUTE = "/v1/audio/speech"
DEFAULT_VOCODER = "vllm_kvbridge.models.tiny_vocoder.TinyVocoder"
HEADER = (
    "bench speech: POST /v1/audio/speech (SSE) through `vllm-kvbridge serve` on {config}; "
    "ceiling: each stage alone with its input whole (full payload edges, same prompts, same run)"
)

__all__ = ["SpeechRequest", "add_arguments", "format_result", "run", "write_json"]


@dataclass
class SpeechRequest:
    """One request as the client saw it (seconds from the request sent)."""

    first_packet_s: float
    total_s: float
    samples: int
    codes: int  # the server's usage.output_tokens: codes vocoded
    audio_s: float

    @property
    def rtf(self) -> float:
        return self.audio_s / self.total_s


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, "the thinker's model (default: the tiny offline model)")
    p.add_argument("--concurrency", default="1,8", help="comma-separated client counts (default 1,8)")
    p.add_argument(
        "--requests",
        type=int,
        default=16,
        help="requests per concurrency and repeat, at least the concurrency (16)",
    )
    p.add_argument("--repeats", type=int, default=3, help="repeats of every load and ceiling (default 3)")
    p.add_argument("--max-tokens", type=int, default=None, help="the thinker's max_tokens (config's default)")
    p.add_argument("--json", metavar="OUT", help="also write the figures and every request as JSON to OUT")


def parse_concurrency(text: str) -> list[int]:
    try:
        levels = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency wants comma-separated integers >= 1, got {text!r}")
    return sorted(set(levels))


def prompt(i: int) -> str:
    return f"speech request {i}"


def shipped_config() -> Path:
    return Path(__file__).resolve().parents[2] / CONFIG


def _vocoder_geometry(config: Path) -> tuple[int, int]:
    """The vocoder's (sample_rate, hop_length), from the module the config names."""
    from vllm_kvbridge.config.resolve import resolve
    from vllm_kvbridge.runner.diffusion_runner import build_section_module
    from vllm_kvbridge.runner.vocoder_runner import MODULE_CONTRACT

    stage = resolve(config).final_stage
    module = build_section_module(
        stage.vocoder or {}, DEFAULT_VOCODER, section="vocoder", required=MODULE_CONTRACT
    )
    return int(module.sample_rate), int(module.hop_length)


def _one(http: httpx.Client, i: int, params: dict[str, Any], rate: int) -> SpeechRequest:
    body = {"input": prompt(i), "stream_format": "sse", "response_format": "pcm", **params}
    first = None
    nbytes = 0
    usage: dict[str, Any] | None = None
    t0 = time.perf_counter()
    with http.stream("POST", ROUTE, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if event["type"] == "speech.audio.delta":
                pcm = base64.b64decode(event["audio"])
                if pcm and first is None:
                    first = time.perf_counter() - t0
                nbytes += len(pcm)
            elif event["type"] == "speech.audio.done":
                usage = event["usage"]
            else:
                raise RuntimeError(f"request {i}: {event}")
    total = time.perf_counter() - t0
    if first is None or usage is None:
        raise RuntimeError(f"request {i}: the stream ended without audio or without speech.audio.done")
    samples = nbytes // 2  # 16-bit PCM
    return SpeechRequest(first, total, samples, int(usage["output_tokens"]), samples / rate)


def _load(url: str, concurrency: int, requests: int, params: dict[str, Any], rate: int) -> dict[str, Any]:
    """``requests`` requests from ``concurrency`` client threads, closed loop."""
    lock = threading.Lock()
    issued = 0
    done: list[SpeechRequest] = []

    def worker() -> None:
        nonlocal issued
        with httpx.Client(base_url=url, timeout=600) as http:
            while True:
                with lock:
                    if issued >= requests:
                        return
                    i, issued = issued, issued + 1
                one = _one(http, i % max(1, concurrency), params, rate)
                with lock:
                    done.append(one)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return {"wall_s": time.perf_counter() - start, "requests": done}


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 0.5),
        "p99": percentile(values, 0.99),
        "min": min(values),
        "max": max(values),
    }


def _figure(value: float, ceiling: float, ratios: list[float], spread: dict[str, float]) -> dict[str, Any]:
    return {
        "value": value,
        "ceiling": ceiling,
        "ratio": value / ceiling,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "spread": spread,
    }


def summarize(
    c: int, loads: list[dict[str, Any]], alone: list[list[StagesAlone]], chunk: int
) -> dict[str, Any]:
    """One concurrency level's figures (pooled over the repeats; ratios per repeat for the spread)."""
    reqs = [r for load in loads for r in load["requests"]]
    ceil_fp = [a.first_packet_s for rep in alone for a in rep]
    codes = statistics.median(r.codes for r in reqs)
    audio_s = statistics.median(r.audio_s for r in reqs)
    # per repeat: the load's figure over the ceiling of the same repeat
    fp_r, rtf_r, agg_r, agg_v, agg_c = [], [], [], [], []
    for load, rep in zip(loads, alone, strict=True):
        rs = load["requests"]
        cfp = percentile([a.first_packet_s for a in rep], 0.5)
        crtf = percentile([audio_s / a.request_s(round(codes), chunk) for a in rep], 0.5)
        fp_r.append(percentile([r.first_packet_s for r in rs], 0.5) / cfp)
        rtf_r.append(percentile([r.rtf for r in rs], 0.5) / crtf)
        agg_v.append(sum(r.audio_s for r in rs) / load["wall_s"])
        agg_c.append(c * crtf)
        agg_r.append(agg_v[-1] / agg_c[-1])
    ceil_rtf = [audio_s / a.request_s(round(codes), chunk) for rep in alone for a in rep]
    fp = [r.first_packet_s for r in reqs]
    rtf = [r.rtf for r in reqs]
    stages = {
        name: percentile([getattr(a, name) for rep in alone for a in rep], 0.5)
        for name in StagesAlone.__dataclass_fields__
    }
    return {
        "concurrency": c,
        "requests": len(reqs),
        "codes_p50": codes,
        "audio_s_p50": audio_s,
        "first_packet_s": _figure(percentile(fp, 0.5), percentile(ceil_fp, 0.5), fp_r, _spread(fp)),
        "rtf": _figure(percentile(rtf, 0.5), percentile(ceil_rtf, 0.5), rtf_r, _spread(rtf)),
        "aggregate_rtf": _figure(statistics.median(agg_v), statistics.median(agg_c), agg_r, _spread(agg_v)),
        "stages_alone_p50_s": stages,
        "ceiling_first_packet_s": _spread(ceil_fp),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the stages alone, then the server; ValueError on bad arguments."""
    from vllm_kvbridge.bench.soak import _Server

    levels = parse_concurrency(args.concurrency)
    if args.requests < 1 or args.repeats < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        raise ValueError("need --requests >= 1, --repeats >= 1 and --max-tokens >= 1")
    config = shipped_config()
    model = chosen_model(args) or tiny_model(None)
    params = {"max_tokens": args.max_tokens} if args.max_tokens else {}
    rate, hop = _vocoder_geometry(config)
    _progress("measuring the stages alone (in process, full payload edges)")
    alone, chunk = measure_stages_alone(config, model, levels, args.repeats, prompt, params or None)
    # the server's request i uses prompt(i % c): the prompts the ceiling of c ran
    tmp = Path(tempfile.mkdtemp(prefix="kvbridge-bench-speech-"))
    server = _Server(str(config), model, tmp / "serve.log")
    loads: dict[int, list[dict[str, Any]]] = {c: [] for c in levels}
    try:
        _progress(f"starting the server (log {tmp / 'serve.log'})")
        server.wait_ready()
        for c in levels:  # warm-up at every batch size the load makes, not counted
            _load(server.url, c, c, params, rate)
        for rep in range(args.repeats):
            for c in levels:
                n = max(c, args.requests)
                _progress(f"repeat {rep + 1}/{args.repeats}: {n} requests at concurrency {c}")
                loads[c].append(_load(server.url, c, n, params, rate))
    finally:
        code = server.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "config": CONFIG,
        "model": model,
        "repeats": args.repeats,
        "requests_per_load": args.requests,
        "max_tokens": args.max_tokens,
        "sample_rate": rate,
        "hop_length": hop,
        "chunk_size": chunk,
        "server_exit": code,
        "levels": [summarize(c, loads[c], alone[c], chunk) for c in levels],
        "loads": {
            str(c): [
                {"wall_s": ld["wall_s"], "requests": [asdict(r) for r in ld["requests"]]} for ld in loads[c]
            ]
            for c in levels
        },
        "stages_alone": {str(c): [[asdict(a) for a in rep] for rep in alone[c]] for c in levels},
    }


def _progress(text: str) -> None:
    print(f"bench speech: {text}", file=sys.stderr, flush=True)


def format_result(r: dict[str, Any]) -> str:
    lines = [
        HEADER.format(config=r["config"]),
        f"{r['repeats']} repeats x {r['requests_per_load']} requests per concurrency; spread: pooled "
        "p50/p99/min/max over the repeats; ratio: value / ceiling, its min-max over the repeats",
    ]
    header = (
        f"{'c':>2}  {'figure':<22}  {'value':>8}  {'ceiling':>8}  {'ratio':>6}  {'ratio min-max':<13}  "
        f"{'p50':>7}  {'p99':>7}  {'min':>7}  {'max':>7}"
    )
    lines += [header, "-" * len(header)]
    names = {
        "first_packet_s": "first packet (s)",
        "rtf": "RTF per request",
        "aggregate_rtf": "RTF aggregate",
    }
    for lv in r["levels"]:
        for key, name in names.items():
            f = lv[key]
            s = f["spread"]
            lines.append(
                f"{lv['concurrency']:>2}  {name:<22}  {f['value']:>8.3f}  {f['ceiling']:>8.3f}  "
                f"{f['ratio']:>5.2f}x  {f['ratio_min']:.2f}-{f['ratio_max']:.2f}x{'':<4}  "
                f"{s['p50']:>7.3f}  {s['p99']:>7.3f}  {s['min']:>7.3f}  {s['max']:>7.3f}"
            )
        st = lv["stages_alone_p50_s"]
        lines.append(
            f"{'':>2}  stages alone p50 (s): thinker first chunk {st['thinker_chunk_s']:.3f}, talker first "
            f"chunk {st['talker_chunk_s']:.3f}, vocoder first audio {st['vocoder_first_s']:.3f}; per code: "
            f"thinker {st['thinker_step_s']:.3f}, talker {st['talker_step_s']:.3f}, vocoder "
            f"{st['vocoder_step_s']:.4f}; {lv['codes_p50']:g} codes = {lv['audio_s_p50']:.2f} s of audio"
        )
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps({"note": HEADER.format(config=r["config"]), **r}, indent=2) + "\n")
