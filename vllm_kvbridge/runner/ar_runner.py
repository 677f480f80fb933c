"""The AR runner: the facade mixin on vLLM's ``GPUModelRunner`` / ``CPUModelRunner``.

What it adds to vLLM's runner:

* **KV is the connector's.** vLLM registers the caches with the worker half of
  :class:`~vllm_kvbridge.runner.vllm_connector.KVBridgeConnector`, which gathers and sends
  (see that module for the triggers and the block-lifetime guarantee); the runner attaches
  itself there once its KV caches exist (:meth:`initialize_kv_cache`) to hear which
  requests end and to answer KV status with its payload status.
* **Hidden-state capture** for payloads (thinker -> talker). ``_model_forward`` returns the
  model's final hidden states (for Llama-style models the final-norm output, what
  ``compute_logits`` consumes), one row per scheduled token in ``input_batch`` row order
  (``query_start_loc``). The runner copies the rows of captured requests there, and in
  ``sample_tokens`` pairs them with the sampled token ids; each step of a request becomes
  ``{"hidden_states": [n, hidden], "token_ids": int64 [k]}`` for the payload flows. Over a
  request that is one row per prompt token and per generated token except the last
  (whose hidden state is never computed), and every generated token id. Rows recomputed
  after a preemption are skipped (positions already captured). Rows a request takes from
  vLLM's prefix cache are never computed, so a request scheduled past positions it has not
  captured fails its payload loudly (the pipeline sends capturing requests with
  ``skip_reading_prefix_cache=True``, so it never hits that).

Capture is on for every request when ``payload.outputs`` is set and
``capture_hidden_states`` / ``capture_token_ids`` ask for it; a request opts out with
``SamplingParams(extra_args={"kvbridge": {"capture": False}})``. It needs synchronous
scheduling (the default on CPU) and no speculative decoding; otherwise the stage refuses to
start (:func:`check_capture_supported`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin, RunnerHost
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.vllm_connector import (
    KVBridgeConnector,
    request_options,
    tp_position,
    transfer_id_for,
)

logger = logging.getLogger(__name__)


def check_capture_supported(vllm_config: Any) -> None:
    """Refuse engine settings under which captured rows would not be the request's own.

    Speculative decoding runs draft tokens through the forward and may reject them, so the
    step's rows would carry hidden states of tokens that were never generated.
    """
    if vllm_config.scheduler_config.async_scheduling:
        raise ConfigError("kvbridge payload capture needs async_scheduling=False")
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        raise ConfigError(
            f"kvbridge hidden-state capture does not support speculative decoding "
            f"(speculative_config method={getattr(spec, 'method', None)!r}): the forward's rows "
            "include draft tokens that may be rejected; start this stage without speculative_config"
        )


class _VLLMRunnerHooks(KVBridgeModelRunnerMixin):
    """vLLM-specific glue shared by the GPU and CPU AR runners."""

    def _kvbridge_setup_from_vllm(self) -> None:
        settings = RunnerSettings.from_vllm_config(self.vllm_config)
        tp_rank, tp_size, tp_group = tp_position()
        self.kvbridge_init(settings, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        payload = settings.payload
        self._kvb_capture_on = bool(payload.outputs) and (
            payload.capture_hidden_states or payload.capture_token_ids
        )
        if self._kvb_capture_on:
            check_capture_supported(self.vllm_config)
        self._kvb_step_rows: dict[str, torch.Tensor] = {}
        self._kvb_scheduler_output: Any = None
        if not isinstance(self, RunnerHost):
            raise ConfigError(f"{type(self).__name__} lacks what the capture hooks read (RunnerHost)")

    # -- vLLM overrides ----------------------------------------------------------------------
    def initialize_kv_cache(self, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(*args, **kwargs)
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        if isinstance(connector, KVBridgeConnector):
            # vLLM registered the caches with it in super(): it built its KV sender there.
            connector.attach_host(self)
            self.kvbridge_connect()  # now, not on the model thread mid-serving
        elif self._kvb_settings.sends_kv or self._kvb_settings.payload.outputs:
            raise ConfigError(
                "this stage sends KV or payloads but vLLM's kv_transfer_config does not install "
                "KVBridgeConnector; start the engine with vllm_kvbridge.runner.worker.engine_kwargs(...)"
            )

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        self._kvb_scheduler_output = scheduler_output
        return super().execute_model(scheduler_output, intermediate_tensors)

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super()._model_forward(*args, **kwargs)
        if self._kvb_capture_on and isinstance(output, torch.Tensor):
            self._kvbridge_capture_rows(output)
        return output

    def sample_tokens(self, grammar_output: Any) -> Any:
        output = super().sample_tokens(grammar_output)
        if self._kvb_capture_on and self._kvb_step_rows:
            self._kvbridge_capture_tokens(output)
        return output

    def shutdown(self) -> None:
        self.kvbridge_shutdown()
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()

    # -- capture -----------------------------------------------------------------------------
    def _kvbridge_capture_rows(self, hidden: torch.Tensor) -> None:
        so = self._kvb_scheduler_output
        self._kvb_step_rows = {}
        if so is None:
            return
        offset = 0
        for req_id in self.input_batch.req_ids:
            n = so.num_scheduled_tokens.get(req_id, 0)
            start_row, offset = offset, offset + n
            req = self.requests.get(req_id)
            if req is None or n == 0:
                continue
            state = self.kvbridge_request_state(req_id)
            if state is None:
                if request_options(req.sampling_params).get("capture") is False:
                    continue
                state = self.kvbridge_register_request(
                    req_id, transfer_id_for(req_id, req.sampling_params), capture=True
                )
            if not state.capture:
                continue
            # Positions of this step's rows; skip those captured before a preemption.
            first_pos = req.num_computed_tokens
            done = state.extra.get("captured", 0)
            if first_pos > done:
                # Rows [done, first_pos) were never computed by this engine: a prefix-cache
                # hit. A payload without them would be silently short, so fail instead.
                self.kvbridge_fail_capture(
                    req_id,
                    f"hidden-state capture would miss prompt positions {done}..{first_pos - 1}: "
                    "they came from vLLM's prefix cache; send capturing requests with "
                    "SamplingParams(skip_reading_prefix_cache=True) (the pipeline does) or start "
                    "the stage with enable_prefix_caching=False",
                )
                continue
            skip = max(0, min(n, done - first_pos))
            rows = hidden[start_row + skip : start_row + n]
            if self._kvb_settings.payload.capture_hidden_states:
                self._kvb_step_rows[req_id] = rows.detach().to("cpu", copy=True)
            else:
                self._kvb_step_rows[req_id] = rows.new_empty((0,))
            state.extra["captured"] = max(done, first_pos + n)

    def _kvbridge_capture_tokens(self, output: Any) -> None:
        rows, self._kvb_step_rows = self._kvb_step_rows, {}
        req_ids = getattr(output, "req_ids", None)
        sampled = getattr(output, "sampled_token_ids", None)
        if req_ids is None or sampled is None:
            logger.warning(
                "kvbridge capture: unexpected model output %s; step skipped", type(output).__name__
            )
            return
        index = {rid: i for i, rid in enumerate(req_ids)}
        payload = self._kvb_settings.payload
        for req_id, hidden in rows.items():
            step: dict[str, Any] = {}
            i = index.get(req_id)
            # Empty for a step that only advanced a chunked prefill.
            tokens = list(sampled[i]) if i is not None and i < len(sampled) else []
            if payload.capture_hidden_states:
                step["hidden_states"] = hidden
            if payload.capture_token_ids:
                step["token_ids"] = torch.tensor(tokens, dtype=torch.int64)
            self.kvbridge_add_step_output(req_id, step, num_tokens=len(tokens))


class KVBridgeARModelRunner(_VLLMRunnerHooks, GPUModelRunner):
    """vLLM's ``GPUModelRunner`` with kvbridge KV sending and payload capture."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._kvbridge_setup_from_vllm()


class KVBridgeCPUModelRunner(_VLLMRunnerHooks, CPUModelRunner):
    """vLLM's ``CPUModelRunner`` with kvbridge KV sending and payload capture."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._kvbridge_setup_from_vllm()


__all__ = ["KVBridgeARModelRunner", "KVBridgeCPUModelRunner", "check_capture_supported"]
