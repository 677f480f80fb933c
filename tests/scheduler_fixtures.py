"""vLLM's real V1 scheduler with the kvbridge KV connector (scheduler role), in-process.

No engine and no model: the test plays the model runner, choosing each step's sampled
tokens, so scheduling decisions (chunked prefill, preemption when blocks run out) happen
exactly as in an engine, deterministically. The connector is the one vLLM builds from
``kv_transfer_config`` (``engine_kwargs``), bound to the scheduler's KV cache manager.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_kvbridge.runner.worker import engine_kwargs

BLOCK = 16


def make_scheduler(
    model_dir: Path,
    settings: dict[str, Any],
    *,
    num_blocks: int,
    block_size: int = BLOCK,
    scheduler_cls: type | None = None,
    kv_cache_groups: list[Any] | None = None,
    **engine_args: Any,
) -> Any:
    """vLLM's ``Scheduler`` (or ``scheduler_cls``, e.g. ``AsyncScheduler``) for the tiny model,
    with one full-attention KV cache group (or ``kv_cache_groups``, vLLM ``KVCacheGroupSpec`` s:
    several make vLLM's hybrid allocator keep one block table per group)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        block_size=block_size,
        **engine_args,
        **engine_kwargs(settings, platform="cpu"),
    )
    config = args.create_engine_config()
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=kv_cache_groups or [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    cls = scheduler_cls or Scheduler
    return cls(config, kv_cache_config, StructuredOutputManager(config), block_size=block_size)


def add_request(scheduler: Any, rid: str, prompt: list[int], max_tokens: int, **kvbridge: Any) -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, extra_args={"kvbridge": {"request_id": rid, **kvbridge}}
    )
    params.update_from_generation_config({}, None)  # what the engine's input processor does
    scheduler.add_request(Request(rid, prompt, params, None))


def step(scheduler: Any, sample: Callable[[str, int], int]) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """One engine step: schedule, then 'run the model': every request whose prompt is fully
    computed samples ``sample(request id, output index)``, and, as the kvbridge worker does
    after its gather, the step's sends whose blocks the scheduler holds are reported as
    ``finished_sending``. Returns the SchedulerOutput and, for each request the step sends,
    the blocks it held when the step ran (when the worker gathers them)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        req = scheduler.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens  # schedule() already counted this step
        sampled.append([sample(rid, len(req.output_token_ids))] if done else [])
    held = {
        spec.req_id: tuple(scheduler.kv_cache_manager.get_block_ids(spec.req_id)[0])
        for spec in out.kv_connector_metadata.sends
    }
    released = {spec.req_id for spec in out.kv_connector_metadata.sends if spec.release}
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        kv_connector_output=KVConnectorOutput(finished_sending=released or None),
    )
    scheduler.update_from_output(out, result)
    return out, held
