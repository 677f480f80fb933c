"""The DiT alone: how many images per second a pipeline's diffusion stage could paint,
batched and not, with nothing in front of it (the ceiling of ``serve``'s image throughput).

``bench all``'s serve figure compares throughput through the server at concurrency 1 and 8;
this measures, in the same run and process, what the diffusion module itself does on the
same configuration: the stage config's ``diffusion`` section (module, kwargs, steps,
``max_batch_size``), conditioned on KV of the shape the tiny LLM sends (its layers, the
module's KV heads and head dim, a prompt of :data:`PROMPT_TOKENS` tokens), through the
runner's own :func:`~vllm_kvbridge.runner.diffusion_batch.denoise_batch`. With one torch
thread, as the stage runs on a CPU host next to a vLLM-CPU engine
(:func:`~vllm_kvbridge.config.platform.cpu_thread_env`).

What it leaves out is what ``serve`` adds: HTTP, the orchestrator, the LLM stage's prefill
(on the same two cores here) and the KV's trip. ``batched / single`` is the most batching
can give through the server; ``serve c=8 / DiT batched`` is how close the server gets.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Prompt tokens of the synthetic KV ("soak request N" is about this long with the template).
PROMPT_TOKENS = 8
#: Layers of the KV: the tiny LLM's (``make-tiny-model``'s default).
KV_LAYERS = 2


@dataclass
class DitAlone:
    """Images per second of the diffusion module alone (medians over ``repeat`` rounds)."""

    batch: int  # the config's max_batch_size
    single_per_s: float  # one request at a time
    batched_per_s: float  # ``batch`` requests denoised together
    single_min_max: tuple[float, float]
    batched_min_max: tuple[float, float]

    @property
    def speedup(self) -> float:
        return self.batched_per_s / self.single_per_s


def measure_dit_alone(stage_config: str | Path, repeat: int = 5) -> DitAlone:
    """Time the config's diffusion module alone at batch 1 and at ``max_batch_size``."""
    import torch

    from vllm_kvbridge.config.loader import load_spec
    from vllm_kvbridge.runner.diffusion_batch import BatchRow, denoise_batch
    from vllm_kvbridge.runner.diffusion_runner import build_module

    spec = load_spec(stage_config)
    stage = next((s for s in spec.stages if s.kind == "diffusion" and s.diffusion), None)
    if stage is None:
        raise ValueError(f"{stage_config} has no diffusion stage")
    d = stage.diffusion
    module = build_module(d.class_path, d.kwargs, d.weights, d.dtype, d.device)
    gen = torch.Generator().manual_seed(0)
    shape = (PROMPT_TOKENS, int(module.kv_heads), int(module.kv_head_dim))
    kv = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(KV_LAYERS)]
    batch = max(1, int(d.max_batch_size))

    def rate(n: int) -> list[float]:
        rows = [BatchRow(f"alone{i}", kv, seed=i) for i in range(n)]
        denoise_batch(module, rows, num_steps=d.num_steps)  # warm-up
        rates = []
        for _ in range(repeat):
            start = time.perf_counter()
            denoise_batch(module, rows, num_steps=d.num_steps)
            rates.append(n / (time.perf_counter() - start))
        return rates

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single, batched = rate(1), rate(batch)
    finally:
        torch.set_num_threads(threads)
    return DitAlone(
        batch,
        statistics.median(single),
        statistics.median(batched),
        (min(single), max(single)),
        (min(batched), max(batched)),
    )


def describe(r: DitAlone) -> dict[str, Any]:
    return {
        "batch": r.batch,
        "single_per_s": r.single_per_s,
        "batched_per_s": r.batched_per_s,
        "single_min_max": list(r.single_min_max),
        "batched_min_max": list(r.batched_min_max),
        "speedup": r.speedup,
    }


__all__ = ["DitAlone", "describe", "measure_dit_alone"]
