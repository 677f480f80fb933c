"""``vllm-kvbridge generate``: run a model (the tiny one by default) through vLLM once.

A quick check that vLLM works on this machine, and the smallest useful job.
"""

from __future__ import annotations

import argparse
import time

from vllm_kvbridge.models.model_args import add_model_arguments, chosen_model, tiny_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="greedy-generate with vLLM (tiny offline model by default)")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    add_model_arguments(p, "model directory (default: the tiny model, built once into the cache)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from vllm_kvbridge.config.platform import detect_platform, platform_engine_args
    from vllm_kvbridge.pipeline.llm_engine import with_platform_kv_cache

    model = chosen_model(args) or tiny_model(None)
    prompts = args.prompt or ["A cute cat"]
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    # The platform's defaults, as a stage gets them (CPU: eager, float32, 512 tokens and a KV
    # cache in host memory sized for what the model can use; GPU: vLLM's own).
    engine_args = with_platform_kv_cache(model, platform_engine_args(detect_platform(), {}))
    llm = LLM(model=model, **engine_args)
    t1 = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    t2 = time.perf_counter()
    print(f"\nmodel: {model}\nengine start: {t1 - t0:.1f} s, generation: {t2 - t1:.2f} s")
    for out in outputs:
        completion = out.outputs[0]
        print(
            f"prompt {out.prompt!r} ({len(out.prompt_token_ids)} tokens) -> "
            f"{completion.text!r} (token ids {list(completion.token_ids)})"
        )
    return 0
