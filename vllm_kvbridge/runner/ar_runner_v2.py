"""The AR runner on vLLM's Model Runner V2 (``vllm.v1.worker.gpu.model_runner``), the GPU
default of vLLM 0.32 and 0.33 wherever Triton exists (the hooks below are the same on both;
0.33's ``defer_finalize`` only moves ``wait_for_save``, see :mod:`~vllm_kvbridge.runner.vllm_compat`).

V2 has no ``_model_forward``: ``execute_model`` runs the forward and leaves the step in
``execute_model_state`` (its ``input_batch`` and the model's final hidden states, one row
per scheduled token in ``input_batch`` order, ``query_start_loc_np``); ``sample_tokens``
samples from it. The capture hook reads that state in ``sample_tokens`` *before* vLLM's
own (the rows are still there; vLLM clears the state), records each captured request's
rows with their positions (``input_batch.num_computed_tokens_np``) and lets vLLM go on.
Token ids come from the scheduler and rows leave the device in one non-blocking copy per
step, as on every runner (:mod:`vllm_kvbridge.runner.capture`), so this works under
async scheduling: nothing here waits for the step's sampled ids.

Not on V2: a stage fed per step (``payload.feed: per_step``; its model is given rows
before the forward, which V2 offers no hook for): the config resolver starts such a GPU
stage on V1 (``VLLM_USE_V2_MODEL_RUNNER=0``, logged), and this runner refuses it with
that reason. Prefill context parallelism shards a step's rows across ranks: refused for
capture stages.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.ar_runner import _VLLMRunnerHooks
from vllm_kvbridge.runner.step_capture import BatchSpan


class KVBridgeV2ARModelRunner(_VLLMRunnerHooks, GPUModelRunnerV2):
    """vLLM's Model Runner V2 ``GPUModelRunner`` with kvbridge payload capture."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._kvbridge_setup_from_vllm()
        settings = self.kvbridge_runtime.settings
        if settings.payload.per_step_inputs:
            raise ConfigError(
                f"stage {settings.stage_id} feeds its payload per step "
                "(payload.feed: per_step), which needs vLLM's V1 model runner: start it with "
                "VLLM_USE_V2_MODEL_RUNNER=0 (the pipeline's config resolver does)"
            )

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        # pcp_manager: built here by vLLM 0.32, in __init__ by 0.33; set on both by now.
        if self._kvb_capture.on and getattr(self, "pcp_manager", None) is not None:
            raise ConfigError(
                "kvbridge hidden-state capture does not support prefill context parallelism "
                "(a step's rows are split across ranks); start this stage without it"
            )

    def sample_tokens(self, grammar_output: Any) -> Any:
        self._kvbridge_before_sampling()
        return super().sample_tokens(grammar_output)

    @torch.inference_mode()  # as vLLM's sample_tokens (the subclass hook may run the model)
    def _kvbridge_before_sampling(self) -> None:
        """Capture this step's rows from ``execute_model_state`` (V2's ``InputBatch`` is the
        forward's row layout); a step with no forward, or a non-last PP rank, has none."""
        state = getattr(self, "execute_model_state", None)
        if not self._kvb_capture.on or state is None or state.hidden_states is None:
            return
        input_batch, hidden = state.input_batch, state.hidden_states
        starts = input_batch.query_start_loc_np
        batch: list[BatchSpan] = [
            (
                req_id,
                int(starts[i]),
                int(input_batch.num_scheduled_tokens[i]),
                int(input_batch.num_computed_tokens_np[i]),
            )
            for i, req_id in enumerate(input_batch.req_ids[: input_batch.num_reqs])
        ]
        self._kvbridge_capture_rows(hidden, batch)


__all__ = ["KVBridgeV2ARModelRunner"]
