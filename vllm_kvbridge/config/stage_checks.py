"""Checks of one stage of a stage config on its own (the resolver checks the edges and the
pipeline as a whole, :mod:`vllm_kvbridge.config.resolve`). Every error is one
:class:`ConfigError` line starting with the key path."""

from __future__ import annotations

import re

from vllm_kvbridge.config.schema import DiffusionSpec, StageSpec, VocoderSpec
from vllm_kvbridge.errors import ConfigError

LLM_KINDS = ("llm_ar", "llm_generation")
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+(:[A-Za-z_][A-Za-z0-9_.]*)?")
#: Engine arguments the resolver owns; a stage setting them in engine_args is a mistake.
_RESERVED_ENGINE_ARGS = ("model", "worker_cls", "tensor_parallel_size", "additional_config")


def _check_dotted(value: str | None, path: str) -> None:
    if value is not None and not _DOTTED.fullmatch(value):
        raise ConfigError(f"{path}: {value!r} is not a dotted path like 'package.module.Name'")


def check_stage(i: int, s: StageSpec) -> None:
    """Every check of ``stages[i]`` that needs no other stage (one ConfigError line naming the key)."""
    p = f"stages[{i}]"
    if s.stage_id < 0:
        raise ConfigError(f"{p}.stage_id: must be >= 0, got {s.stage_id}")
    if s.tensor_parallel_size < 1:
        raise ConfigError(f"{p}.tensor_parallel_size: must be >= 1, got {s.tensor_parallel_size}")
    if s.replicas < 1:
        raise ConfigError(f"{p}.replicas: must be >= 1, got {s.replicas}")
    if s.replicas > 1 and s.url is not None:
        raise ConfigError(f"{p}.replicas: an external stage (url) is one server; it cannot have replicas")
    if s.replicas > 1 and s.devices is not None and len(s.devices.split(",")) % s.replicas:
        raise ConfigError(
            f"{p}.devices: {len(s.devices.split(','))} device(s) cannot be split evenly among "
            f"{s.replicas} replicas (each replica takes its own, in order)"
        )
    if s.start_timeout <= 0:
        raise ConfigError(f"{p}.start_timeout: must be > 0, got {s.start_timeout}")
    listed = isinstance(s.placement, list)
    if listed and len(s.placements()) != s.replicas:
        raise ConfigError(
            f"{p}.placement: a list of {len(s.placements())} placement(s) for {s.replicas} replica(s) "
            "(one per replica, in order; or one placement for all)"
        )
    for k, placement in enumerate(s.placements()):
        where = f"{p}.placement[{k}]" if listed else f"{p}.placement"
        for key, amount in placement.resources.items():
            if not amount >= 0:
                raise ConfigError(f"{where}.resources.{key}: must be >= 0, got {amount}")
    if len({pl.resources.get("GPU", 0) for pl in s.placements()}) > 1:
        raise ConfigError(f"{p}.placement: every replica holds the same GPU count (one platform per stage)")
    kv, pl = s.kv_transfer, s.payload
    for name in ("recv_timeout", "send_timeout"):
        if getattr(kv, name) <= 0:
            raise ConfigError(f"{p}.kv_transfer.{name}: must be > 0, got {getattr(kv, name)}")
    if kv.max_send_queue_bytes < 1:
        got = kv.max_send_queue_bytes
        raise ConfigError(f"{p}.kv_transfer.max_send_queue_bytes: must be >= 1, got {got}")
    if kv.staging_bytes is not None and kv.staging_bytes < 0:
        raise ConfigError(f"{p}.kv_transfer.staging_bytes: must be >= 0, got {kv.staging_bytes}")
    if kv.trigger == "special_token" and kv.trigger_token_id is None:
        raise ConfigError(f"{p}.kv_transfer.trigger_token_id: required when trigger is 'special_token'")
    if kv.trigger != "special_token" and kv.trigger_token_id is not None:
        raise ConfigError(f"{p}.kv_transfer.trigger_token_id: only valid with trigger 'special_token'")
    if kv.stop_after_transfer and kv.trigger != "prefill_finished":
        raise ConfigError(f"{p}.kv_transfer.stop_after_transfer: only valid with trigger 'prefill_finished'")
    if kv.expect is not None:
        if not kv.need_recv_cache:
            raise ConfigError(f"{p}.kv_transfer.expect: only valid on a stage that receives KV")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(kv.expect, name)
            if value is not None and value < 1:
                raise ConfigError(f"{p}.kv_transfer.expect.{name}: must be >= 1, got {value}")
    if pl.chunk_size < 1:
        raise ConfigError(f"{p}.payload.chunk_size: must be >= 1, got {pl.chunk_size}")
    if pl.feed == "per_step" and (s.kind not in LLM_KINDS or s.url is not None):
        raise ConfigError(
            f"{p}.payload.feed: per_step feeds a vLLM engine's model (this stage is {s.kind!r})"
        )
    for name in ("stall_timeout", "recv_timeout", "send_timeout"):
        if getattr(pl, name) <= 0:
            raise ConfigError(f"{p}.payload.{name}: must be > 0, got {getattr(pl, name)}")
    _check_dotted(
        pl.custom_process_next_stage_input_func, f"{p}.payload.custom_process_next_stage_input_func"
    )
    _check_dotted(s.worker_cls, f"{p}.worker_cls")
    _check_dotted(s.runner_cls, f"{p}.runner_cls")
    for key in _RESERVED_ENGINE_ARGS:
        if key in s.engine_args:
            raise ConfigError(f"{p}.engine_args.{key}: set it as a stage field, not an engine argument")
    if s.url is not None:
        if s.kind not in LLM_KINDS:
            raise ConfigError(f"{p}.url: only LLM stages can be external servers (this stage is {s.kind!r})")
        if not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", s.url):
            raise ConfigError(f"{p}.url: {s.url!r} is not an http(s) URL like 'http://127.0.0.1:8001'")
    if s.kind != "diffusion" and s.diffusion is not None:
        raise ConfigError(f"{p}.diffusion: only valid for kind 'diffusion' (this stage is {s.kind!r})")
    if s.kind != "vocoder" and s.vocoder is not None:
        raise ConfigError(f"{p}.vocoder: only valid for kind 'vocoder' (this stage is {s.kind!r})")
    if s.kind == "vocoder":
        if s.tensor_parallel_size != 1:
            raise ConfigError(
                f"{p}.tensor_parallel_size: vocoder stages run on one rank, got {s.tensor_parallel_size}"
            )
        if kv.need_send_cache or kv.need_recv_cache:
            which = "need_send_cache" if kv.need_send_cache else "need_recv_cache"
            raise ConfigError(f"{p}.kv_transfer.{which}: a vocoder stage consumes payloads, not KV")
        for name in ("worker_cls", "runner_cls", "model"):
            if getattr(s, name) is not None:
                raise ConfigError(
                    f"{p}.{name}: vocoder stages host the module of 'vocoder', not a vLLM model"
                )
        if s.engine_args:
            raise ConfigError(f"{p}.engine_args: vocoder stages run no vLLM engine")
        _check_dotted((s.vocoder or VocoderSpec()).class_path, f"{p}.vocoder.class_path")
    elif s.kind == "diffusion":
        if s.tensor_parallel_size != 1:
            raise ConfigError(
                f"{p}.tensor_parallel_size: diffusion stages run on one rank, got {s.tensor_parallel_size}"
            )
        if kv.need_send_cache:
            raise ConfigError(f"{p}.kv_transfer.need_send_cache: a diffusion stage does not produce KV")
        for name in ("worker_cls", "runner_cls"):
            if getattr(s, name) is not None:
                raise ConfigError(f"{p}.{name}: diffusion stages run the diffusion runner, not a vLLM worker")
        d = s.diffusion or DiffusionSpec()
        _check_dotted(d.class_path, f"{p}.diffusion.class_path")
        if d.num_steps < 1:
            raise ConfigError(f"{p}.diffusion.num_steps: must be >= 1, got {d.num_steps}")
        if not d.guidance_scale >= 0:
            raise ConfigError(f"{p}.diffusion.guidance_scale: must be >= 0, got {d.guidance_scale}")
        if d.num_ranks not in (1, 2):
            raise ConfigError(f"{p}.diffusion.num_ranks: 1 or 2 (CFG-parallel), got {d.num_ranks}")
        if d.num_ranks == 2 and not kv.need_recv_cache:
            raise ConfigError(
                f"{p}.diffusion.num_ranks: 2 ranks split guided KV-conditioned requests; "
                "this stage receives no KV"
            )
        if d.max_batch_size < 1:
            raise ConfigError(f"{p}.diffusion.max_batch_size: must be >= 1, got {d.max_batch_size}")
        if d.num_ranks == 2 and d.max_batch_size != 1:
            raise ConfigError(
                f"{p}.diffusion.max_batch_size: a 2-rank (CFG-parallel) stage denoises one request "
                f"at a time, got {d.max_batch_size}; use num_ranks: 1 to batch requests"
            )
    else:
        if kv.need_recv_cache:
            raise ConfigError(f"{p}.kv_transfer.need_recv_cache: LLM stages cannot consume KV caches yet")


__all__ = ["LLM_KINDS", "check_stage"]
