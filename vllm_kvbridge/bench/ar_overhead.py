"""Decode throughput of an AR engine with kvbridge KV sending on vs off.

Two engines on the same model, one after the other: a plain vLLM engine (the ceiling)
and the kvbridge CPU/GPU worker sending every request's KV on finish through shared
memory to a receiver thread in this process that drains it. Each runs the same batch of
requests (greedy, ``ignore_eos``) after a warm-up batch; the figure is generated tokens per
second and the ratio kvbridge / plain. The kvbridge engine starts inside
:func:`~vllm_kvbridge.runner.worker.engine_env`, as a stage does (without it vLLM-CPU binds
the worker's threads differently once a KV connector is configured; see that module). The
receiver drains the KV after the timed run (it stands for a stage on other cores) and the
count of KV caches received is printed.
Run: ``python -m vllm_kvbridge.bench.ar_overhead`` or ``vllm-kvbridge bench ar-overhead``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any


def _engine(model: str, extra: dict[str, Any], args: argparse.Namespace) -> Any:
    from vllm import LLM

    return LLM(
        model=model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        seed=0,
        block_size=args.block_size,
        **extra,
    )


def _batch(args: argparse.Namespace, tag: str) -> tuple[list[Any], list[Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params = [], []
    for i in range(args.requests):
        ids = [5 + (j * 37 + i * 101) % 490 for j in range(args.prompt_len)]
        prompts.append(TokensPrompt(prompt_token_ids=ids))
        params.append(
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=0.0,
                ignore_eos=True,
                extra_args={"kvbridge": {"request_id": f"{tag}{i}"}},
            )
        )
    return prompts, params


def _timed(llm: Any, args: argparse.Namespace, tag: str) -> float:
    # Warm up with the full batch: the first large batch of an engine runs ~2x slower here
    # (kvbridge or not), which would otherwise dominate the comparison.
    prompts, params = _batch(args, tag + "w")
    llm.generate(prompts, params, use_tqdm=False)
    prompts, params = _batch(args, tag)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def run(args: argparse.Namespace) -> dict[str, float]:
    from vllm_kvbridge.kv.config import KVTransferConfig
    from vllm_kvbridge.kv.manager import KVTransferManager
    from vllm_kvbridge.models.tiny_llama import make_tiny_model
    from vllm_kvbridge.runner.worker import engine_env, engine_kwargs

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = args.model or str(make_tiny_model(args.cache_dir, seed=0))

    plain = _engine(model, {}, args)
    try:
        base = _timed(plain, args, "p")
    finally:
        plain.llm_engine.engine_core.shutdown()

    ns = f"bench{os.getpid()}"
    edge = {"connector": "SharedMemoryConnector", "connector_config": {"namespace": ns}}
    settings = {"stage_id": 0, "kv_transfer": {"need_send_cache": True, "to_stage": 1, **edge}}
    receiver = KVTransferManager(
        KVTransferConfig.from_dict(
            {"need_recv_cache": True, "from_stage": 0, "stage_id": 1, "recv_timeout": 120, **edge}
        ),
        num_kv_heads=args.num_kv_heads,
    )
    received: list[int] = []

    def drain() -> None:
        for tag in ("kw", "k"):
            for i in range(args.requests):
                _, nbytes = receiver.receive_kv_cache_for_request(f"{tag}{i}")
                received.append(nbytes)

    with engine_env():
        bridged = _engine(model, engine_kwargs(settings), args)
    try:
        kv = _timed(bridged, args, "k")
        # Drained after the timed run: on this 2-core machine a polling receiver would
        # compete with the engine for CPU, which a receiving stage on its own cores does not.
        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        thread.join(120)
    finally:
        bridged.llm_engine.engine_core.shutdown()
        receiver.shutdown()
    timed = received[args.requests :]
    return {
        "plain_tok_s": base,
        "kvbridge_tok_s": kv,
        "ratio": kv / base,
        "kv_requests_received": float(len(timed)),
        "kv_bytes": float(sum(timed)),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model dir (default: the tiny model, built into --cache-dir)")
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/vllm-kvbridge/tiny-llama"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--num-kv-heads", type=int, default=2, help="the model's KV heads (tiny model: 2)")
    p.add_argument("--dtype", default="float32")


def format_result(r: dict[str, float]) -> str:
    return (
        f"decode throughput: plain {r['plain_tok_s']:.1f} tok/s, kvbridge KV on finish "
        f"{r['kvbridge_tok_s']:.1f} tok/s, ratio {r['ratio']:.3f} "
        f"({int(r['kv_requests_received'])} KV caches, {r['kv_bytes'] / 1e6:.1f} MB received)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    print(format_result(run(p.parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
