"""Decode throughput of an AR engine with kvbridge KV sending on vs off, interleaved.

Two engines on the same KV-heavy model (:mod:`vllm_kvbridge.bench.kv_model`: 28 layers x
4 KV heads x head_dim 128 by default, small hidden size, random weights) are alive at once:
a plain vLLM engine (the ceiling) and one configured as a kvbridge stage (vLLM's stock
worker with the kvbridge KV connector, started inside
:func:`~vllm_kvbridge.runner.worker.engine_env` as a stage is) that sends every finished
request's KV through shared memory to a receiver in this process.

Each timed sample is one batch of ``--requests`` requests (greedy, ``ignore_eos``; a
quarter each stop at 100%, 87.5%, 75% and 62.5% of ``--max-tokens``, so KV leaves while
the rest of the batch decodes). Every batch reuses the same prompts, so after the warm-up
batch (one per engine, untimed) their prefill is a prefix-cache hit on both engines alike
and the timed work is decode. The figure is generated tokens per second of the batch.

Samples alternate between the engines, ``--repeat`` pairs, the order flipped every pair
(plain-kvbridge, kvbridge-plain, ...) so a drift of the machine, or the second batch of a
pair running slower than the first, hits both sides alike (the median ratio of each order
is printed too: their difference is that order effect; an even ``--repeat`` balances it).
Before each batch the bench waits ``--settle-s`` seconds: vLLM's idle worker keeps
spinning for 1 s after its last step, which would steal a core from the other engine.
The receiver drains the KV of a kvbridge batch after its timed window (a receiving stage
runs on its own cores; here it would compete with the engine for the machine's CPUs),
and before the next batch starts, so every batch sends into the same state.

Reported: min and median tok/s of each side; the ratio kvbridge / plain per pair (median
and min..max), the slowdown ``1 - median ratio``; and the noise floor: how much the plain
repeats differ among themselves with nothing changed (``(max - min) / median``). A
slowdown below the noise floor is not a measured slowdown.
Run: ``python -m vllm_kvbridge.bench.ar_overhead`` or ``vllm-kvbridge bench ar-overhead``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from vllm_kvbridge.config.platform import detect_platform, platform_engine_args

logger = logging.getLogger(__name__)

PLAIN, KVBRIDGE = "plain", "kvbridge"


def _engine(model: str, extra: dict[str, Any], args: argparse.Namespace) -> Any:
    from vllm import LLM

    from vllm_kvbridge.bench.kv_model import cpu_kv_cache_args

    # The platform's defaults as a stage gets them (eager on CPU only), under the bench's
    # own dtype and sizes.
    own = {
        "dtype": args.dtype,
        "max_model_len": args.prompt_len + args.max_tokens + 16,
        "block_size": args.block_size,
    }
    return LLM(
        model=model,
        **platform_engine_args(detect_platform(), own),
        **cpu_kv_cache_args(args.kv_cache_gib),
        **extra,
    )


def max_tokens_of(i: int, max_tokens: int) -> int:
    """Generated tokens of request ``i`` of a batch: quarters stop at 8/8, 7/8, 6/8, 5/8."""
    return max(1, max_tokens * (8 - i % 4) // 8)


def _batch(args: argparse.Namespace, tag: str) -> tuple[list[Any], list[Any], list[str]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params, ids = [], [], []
    for i in range(args.requests):
        tokens = [5 + (j * 37 + i * 101) % 490 for j in range(args.prompt_len)]
        prompts.append(TokensPrompt(prompt_token_ids=tokens))
        rid = f"{tag}-{i}"
        ids.append(rid)
        params.append(
            SamplingParams(
                max_tokens=max_tokens_of(i, args.max_tokens),
                temperature=0.0,
                ignore_eos=True,
                extra_args={"kvbridge": {"request_id": rid}},
            )
        )
    return prompts, params, ids


class _Side:
    """One engine of the comparison; a kvbridge side also drains its KV after each batch."""

    def __init__(self, name: str, llm: Any, receiver: Any = None) -> None:
        self.name, self.llm, self.receiver = name, llm, receiver
        self.kv_received = 0
        self.kv_bytes = 0

    def batch(self, args: argparse.Namespace, tag: str) -> tuple[int, float]:
        """(generated tokens, seconds) of one batch; then the KV is drained (untimed)."""
        prompts, params, ids = _batch(args, f"{self.name}{tag}")
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if self.receiver is not None:
            for rid in ids:
                data, nbytes = self.receiver.receive_kv_cache_for_request(rid)
                del data  # frees the shared-memory segment for the sender's next put
                self.kv_received += 1
                self.kv_bytes += nbytes
        return tokens, seconds

    def shutdown(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def _reap(settings: dict[str, Any]) -> None:
    """Remove what the kvbridge engine's (now dead) worker may have left in shared memory: vLLM
    SIGKILLs an engine core that does not stop within 5 s, before its connector released."""
    from vllm_kvbridge.runner.stage_runtime import reap_stage_leftovers

    try:
        reap_stage_leftovers(settings)
    except Exception:  # best effort: the next kvbridge process on the edge reaps them too
        logger.debug("ar-overhead: reaping leftovers failed", exc_info=True)


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per side min/median/max tok/s, per-pair ratios, slowdown and noise floor of ``samples``
    (dicts with ``side``, ``pair`` and ``tok_s``)."""
    by_side = {
        side: [s["tok_s"] for s in sorted(samples, key=lambda s: s["pair"]) if s["side"] == side]
        for side in (PLAIN, KVBRIDGE)
    }
    pairs = sorted({s["pair"] for s in samples})
    tok = {(s["pair"], s["side"]): s["tok_s"] for s in samples}
    ratios = [tok[p, KVBRIDGE] / tok[p, PLAIN] for p in pairs if (p, KVBRIDGE) in tok and (p, PLAIN) in tok]
    plain = _summary(by_side[PLAIN])
    ratio = _summary(ratios)
    # Pairs run plain first (even) or kvbridge first (odd): a difference between the two
    # medians is an order effect (the second batch of a pair runs slower or faster), which
    # the alternation cancels in the overall median when both orders are equally many.
    by_order = {
        "plain_first": [r for p, r in zip(pairs, ratios) if p % 2 == 0],
        "kvbridge_first": [r for p, r in zip(pairs, ratios) if p % 2 == 1],
    }
    return {
        PLAIN: plain,
        KVBRIDGE: _summary(by_side[KVBRIDGE]),
        "ratios": ratios,
        "ratio": ratio,
        "ratio_by_order": {k: statistics.median(v) for k, v in by_order.items() if v},
        "slowdown": 1.0 - ratio["median"],
        "noise_floor": (plain["max"] - plain["min"]) / plain["median"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_kvbridge.bench.kv_model import ensure_kv_heavy_model, kv_bytes, model_layers
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.manager import KVTransferManager
    from vllm_kvbridge.runner.worker import engine_env, engine_kwargs

    if args.repeat < 1 or args.requests < 1 or args.max_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--repeat, --requests, --max-tokens and --prompt-len must be >= 1")
    model = args.model or str(ensure_kv_heavy_model(args.layers, cache_dir=args.cache_dir))
    layers = model_layers(model)
    tokens_per_batch = args.requests * (args.prompt_len + args.max_tokens)
    need = 2 * kv_bytes(tokens_per_batch, layers, args.dtype) / (1 << 30)  # two batches' worth
    args.kv_cache_gib = args.kv_cache_gib or max(1, round(need + 0.5))

    ns = f"arov{os.getpid()}"
    edge = {"connector": "SharedMemoryConnector", "connector_config": {"namespace": ns}}
    settings = {"stage_id": 0, "kv_transfer": {"need_send_cache": True, "to_stage": 1, **edge}}
    sides: dict[str, _Side] = {}
    receiver = None
    try:
        sides[PLAIN] = _Side(PLAIN, _engine(model, {}, args))
        receiver = KVTransferManager(
            KVTransferConfig.from_dict(
                {"need_recv_cache": True, "from_stage": 0, "stage_id": 1, "recv_timeout": 120, **edge}
            )
        )
        with engine_env():
            sides[KVBRIDGE] = _Side(KVBRIDGE, _engine(model, engine_kwargs(settings), args), receiver)
        # Warm-up, untimed: the first batch of an engine runs slower (and computes the
        # prompts' prefill, which every later batch finds in the prefix cache).
        for side in sides.values():
            side.batch(args, "w")
        samples: list[dict[str, Any]] = []
        for pair in range(args.repeat):
            order = (PLAIN, KVBRIDGE) if pair % 2 == 0 else (KVBRIDGE, PLAIN)
            for name in order:
                time.sleep(args.settle_s)
                tokens, seconds = sides[name].batch(args, f"p{pair}")
                samples.append(
                    {
                        "side": name,
                        "pair": pair,
                        "tokens": tokens,
                        "seconds": seconds,
                        "tok_s": tokens / seconds,
                    }
                )
    finally:
        for side in sides.values():
            side.shutdown()
        if receiver is not None:
            receiver.shutdown()
        _reap(settings)
    bridged = sides[KVBRIDGE]
    return {
        "model": model,
        "layers": layers,
        "dtype": args.dtype,
        "requests": args.requests,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "samples": samples,
        "summary": summarize(samples),
        "kv_caches_received": bridged.kv_received,
        "kv_bytes_received": bridged.kv_bytes,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model dir (default: the KV-heavy model, built into --cache-dir)")
    p.add_argument("--cache-dir", help="where the KV-heavy model is built (default: the kvbridge cache dir)")
    p.add_argument("--layers", type=int, default=28, help="layers of the KV-heavy model (default 28)")
    p.add_argument("--requests", type=int, default=32, help="requests per timed batch (default 32)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="tokens generated by the longest requests; a quarter each stop at 8/8..5/8 of it (default 64)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=6,
        help="timed batches per side, interleaved; even balances the order (6)",
    )
    p.add_argument("--settle-s", type=float, default=1.5, help="idle seconds before each batch (default 1.5)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument(
        "--kv-cache-gib", type=int, help="KV cache on CPU per engine, GiB (default: fits the batch)"
    )
    p.add_argument("--json", metavar="OUT", help="also write samples and summary as JSON to OUT")


def format_result(r: dict[str, Any]) -> str:
    s = r["summary"]
    lines = [
        f"ar-overhead: {Path(r['model']).name} ({r['layers']} layers, {r['dtype']}), "
        f"{r['requests']} requests x ({r['prompt_len']} prompt + up to {r['max_tokens']} generated) "
        "per batch, "
        f"{r['repeat']} interleaved batches per side",
        f"{'pair':>4} {'order':<17} {'plain tok/s':>12} {'kvbridge tok/s':>15} {'ratio':>7}",
    ]
    tok = {(x["pair"], x["side"]): x["tok_s"] for x in r["samples"]}
    for pair, ratio in enumerate(s["ratios"]):
        order = "plain, kvbridge" if pair % 2 == 0 else "kvbridge, plain"
        lines.append(
            f"{pair:>4} {order:<17} {tok[pair, PLAIN]:>12.1f} {tok[pair, KVBRIDGE]:>15.1f} {ratio:>7.3f}"
        )
    lines.append(f"{'side':<9} {'min tok/s':>10} {'median tok/s':>13} {'max tok/s':>10}")
    for side in (PLAIN, KVBRIDGE):
        lines.append(f"{side:<9} {s[side]['min']:>10.1f} {s[side]['median']:>13.1f} {s[side]['max']:>10.1f}")
    ratio = s["ratio"]
    verdict = "within" if abs(s["slowdown"]) <= s["noise_floor"] else "beyond"
    lines += [
        f"kvbridge / plain: median ratio {ratio['median']:.3f} "
        f"(pairs {ratio['min']:.3f}..{ratio['max']:.3f}), "
        f"slowdown {s['slowdown'] * 100:.1f}% ({verdict} the noise floor)",
        "median ratio by order: "
        + ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in s.get("ratio_by_order", {}).items()),
        f"noise floor on this machine: {s['noise_floor'] * 100:.1f}% "
        "(plain batches' tok/s, (max - min) / median, nothing changed between them)",
        f"KV received: {r['kv_caches_received']} caches, {r['kv_bytes_received'] / 1e9:.2f} GB "
        "(warm-up included; drained after each batch's timed window)",
    ]
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: str) -> None:
    Path(path).write_text(json.dumps(r, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    result = run(args)
    print(format_result(result))
    if args.json:
        write_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
