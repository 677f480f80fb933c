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

A stage fed per step (``payload.feed: per_step``; :mod:`vllm_kvbridge.runner.conditioning`)
runs on V2 as on V1: the model is given the step's rows before the forward, in the
forward's token order. V2's hook for that is ``prepare_inputs(scheduler_output, ...)``:
``execute_model`` calls it on every real step (never on dummy runs) and gets back the
``InputBatch`` that fixes the token layout (``req_ids`` in ``sort_batch_req_ids`` order,
not the scheduler's; ``num_scheduled_tokens``; ``query_start_loc_np``), before the
model's own ``model_state.prepare_inputs``, before ``kv_connector.pre_forward`` and before
the forward in all three of V2's modes (eager, PIECEWISE through
``cudagraph_manager.run_pw_graph``, FULL through ``run_fullgraph``'s replay). The override
hands the model ``step_rows`` in that order (the code V1 runs in ``_model_forward``). The
rows come in the step's ``scheduler_output.kv_connector_metadata`` (``conditioning``),
the object ``pre_forward`` binds a moment later: binding changes nothing the feed reads.
A FULL graph replays kernels reading the model's fixed buffer, written (stream-ordered)
before the replay; tokens padded past ``input_batch.num_tokens`` read zeros there (the
model's hook contract). vLLM 0.32 and 0.33 have the same ``prepare_inputs`` signature and
call site. Two V2 features move tokens on the device after ``prepare_inputs`` laid them
out and are refused for a fed stage at ``initialize_kv_cache``: prefill context
parallelism and adaptive draft verification. Prefill context parallelism is refused for
capture stages too (it shards a step's rows across ranks).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.ar_runner import _VLLMRunnerHooks
from vllm_kvbridge.runner.step_capture import BatchSpan


class KVBridgeV2ARModelRunner(_VLLMRunnerHooks, GPUModelRunnerV2):
    """vLLM's Model Runner V2 ``GPUModelRunner`` with kvbridge payload capture and per-step
    conditioning (see the module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._kvbridge_setup_from_vllm()

    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        # pcp_manager: built here by vLLM 0.32, in __init__ by 0.33; adaptive_verification:
        # here by both. Set on both by now.
        if self._kvb_capture.on and getattr(self, "pcp_manager", None) is not None:
            raise ConfigError(
                "kvbridge hidden-state capture does not support prefill context parallelism "
                "(a step's rows are split across ranks); start this stage without it"
            )
        if self._kvb_capture.feed_dim is not None:
            # The feed lays a step's rows out on the host, one run per request in batch
            # order; these two move tokens on the device after prepare_inputs laid them out.
            for name, what in (
                ("pcp_manager", "prefill context parallelism (a step's tokens are split across ranks)"),
                (
                    "adaptive_verification",
                    "adaptive draft verification (the device re-deals a step's draft tokens)",
                ),
            ):
                if getattr(self, name, None) is not None:
                    raise ConfigError(
                        f"stage {self.kvbridge_runtime.settings.stage_id} feeds its payload per step "
                        f"(payload.feed: per_step), which does not support {what}; start it without it"
                    )

    def prepare_inputs(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        input_batch = super().prepare_inputs(scheduler_output, *args, **kwargs)
        if self._kvb_capture.feed_dim is not None:
            self._kvbridge_feed_v2(input_batch)
        return input_batch

    def _kvbridge_feed_v2(self, input_batch: Any) -> None:
        """Give the model the rows of the step ``input_batch`` lays out (V2's sorted order;
        request ``i``'s tokens start at ``query_start_loc_np[i]``, contiguous, so the rows of
        ``step_rows`` in that order line up with them). Padded tokens past
        ``input_batch.num_tokens`` get no row: the model's buffer holds zeros there."""
        num_reqs = input_batch.num_reqs
        req_ids = list(input_batch.req_ids[:num_reqs])
        counts = dict(zip(req_ids, (int(n) for n in input_batch.num_scheduled_tokens[:num_reqs])))
        self._kvbridge_feed_model(req_ids, counts)

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
