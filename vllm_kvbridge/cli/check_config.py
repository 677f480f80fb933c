"""``vllm-kvbridge check-config FILE``: validate a stage config and print the resolved plan.

Exit status 0 when the file is valid, 1 with a one-line ``error: <key path>: <why>``
otherwise. ``--json`` prints the resolved plan (including each LLM stage's runner
settings) as JSON instead of text. ``--platform cpu|cuda`` resolves for that platform
instead of this host's: each LLM stage's ``engine_args`` line is what its engine really
gets there (:mod:`vllm_kvbridge.config.platform`).

A diffusion stage fed KV by an LLM stage takes its KV geometry (``kv_heads``,
``kv_head_dim``) from that stage's model (:mod:`vllm_kvbridge.config.kv_geometry`); the
plan says which model and what it gave. An LLM stage naming no model is resolved against
``--model``, ``--arch`` or the tiny Llama, as ``run`` and ``serve`` would (the tiny model is
built once into the cache).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from vllm_kvbridge.config.kv_geometry import describe_geometry, fill_kv_geometry
from vllm_kvbridge.config.locality import bind_auto_edges, describe_auto, local_node
from vllm_kvbridge.config.platform import CPU, PLATFORMS
from vllm_kvbridge.config.resolve import (
    AUTO_CONNECTOR,
    ResolvedEdge,
    ResolvedPipeline,
    ResolvedStage,
    resolve,
)
from vllm_kvbridge.config.runner_settings import runner_settings
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.models.model_args import add_model_arguments, tiny_model_name


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check-config",
        help="validate a stage config and print the resolved plan",
        description="Validate a YAML stage config and print the per-stage plan.",
    )
    p.add_argument("file", help="stage config (YAML)")
    p.add_argument("--json", action="store_true", help="print the resolved plan as JSON")
    p.add_argument(
        "--platform",
        choices=PLATFORMS,
        default=None,
        help="resolve for this platform (default: this host's): each LLM stage's engine_args are "
        "what its engine really gets there (cpu: eager, float32, 512 tokens; cuda: vLLM's defaults)",
    )
    add_model_arguments(
        p,
        "resolve LLM stages that name no model against this one (default: the tiny offline model); "
        "the DiT's KV geometry is read from it",
    )
    p.set_defaults(func=_run)


def _carries(e: ResolvedEdge) -> str:
    parts = (["kv"] if e.kv else []) + ([f"payload ({e.payload_mode})"] if e.payload_mode != "none" else [])
    return " + ".join(parts)


def _connector(e: ResolvedEdge, plan: ResolvedPipeline) -> str:
    if e.connector.name != AUTO_CONNECTOR:
        return f"{e.connector.name} ('{e.connector.ref}')"
    if plan.backend == "local":  # every stage on this host: decided already
        bound = bind_auto_edges(plan, {s.stage_id: local_node() for s in plan.stages})
        c = next(x.connector for x in bound.stage(e.from_stage).outputs if x.to_stage == e.to_stage)
        return f"{c.name} ('{c.ref}', auto: local backend, one host)"
    return describe_auto(plan)


def _stage_lines(s: ResolvedStage, plan: ResolvedPipeline) -> list[str]:
    head = f"stage {s.stage_id}  {s.kind}"
    lines = []
    if s.is_llm:
        lines.append(f"{head}  model={s.model or '<--model / tiny model>'}  tp={s.tensor_parallel_size}")
        lines.append(f"  worker_cls: {s.worker_cls or 'vLLM stock worker (the KV connector sends)'}")
        if s.runner_cls:
            lines.append(f"  runner_cls: {s.runner_cls}")
        lines.append(f"  engine_args: {json.dumps(s.engine_args, sort_keys=True)}")
        if s.platform == CPU:
            lines.append("  kv cache: sized at start for a full batch of max_model_len tokens (<= 1 GiB)")
        else:
            lines.append("  vLLM defaults: CUDA graphs, the model's dtype, Model Runner V2, async scheduling")
        if s.env:
            lines.append(f"  env: {json.dumps(s.env, sort_keys=True)}")
        if s.platform != plan.platform:
            lines.append(f"  platform: {s.platform} (placed by Ray on a GPU)")
        if s.default_sampling_params:
            lines.append(f"  sampling: {json.dumps(s.default_sampling_params, sort_keys=True)}")
    elif s.vocoder is not None:
        v = s.vocoder
        lines.append(
            f"{head}  module={v.get('class_path')}  input={v.get('input_key')}  "
            f"weights={v.get('weights') or 'random (seeded)'}"
        )
        if v.get("kwargs"):
            lines.append(f"  kwargs: {json.dumps(v['kwargs'], sort_keys=True)}")
        lines.append("  streams: each arriving chunk becomes audio at once (last stage)")
    else:
        d = s.diffusion or {}
        lines.append(
            f"{head}  module={d.get('class_path')}  steps={d.get('num_steps')}  "
            f"weights={d.get('weights') or 'random (seeded)'}"
        )
        if d.get("kwargs"):
            lines.append(f"  kwargs: {json.dumps(d['kwargs'], sort_keys=True)}")
        geometry = describe_geometry(s)
        if geometry:
            lines.append(f"  {geometry}")
        if float(d.get("guidance_scale", 1.0)) != 1.0:
            lines.append(
                f"  guidance: scale {d['guidance_scale']}, negative prompt {d.get('negative_prompt', '')!r} "
                "(its KV comes as the 'cfg_neg' companion)"
            )
        if int(d.get("max_batch_size", 1)) > 1:
            lines.append(
                f"  batching: up to {d['max_batch_size']} requests of the same steps denoised together"
            )
        if int(d.get("num_ranks", 1)) > 1:
            lines.append(f"  ranks: {d['num_ranks']}, CFG-parallel (rank 0 receives and distributes the KV)")
    lines.extend(_replica_lines(s, plan))
    kv = s.kv_transfer
    if kv.get("need_send_cache"):
        extra = f", token {kv['trigger_token_id']}" if kv.get("trigger_token_id") is not None else ""
        lines.append(
            f"  kv send: trigger {kv['trigger']}{extra}"
            + (", stop after transfer" if kv.get("stop_after_transfer") else "")
        )
    if kv.get("need_recv_cache"):
        lines.append(
            f"  kv receive: timeout {kv['recv_timeout']:g} s, prefetch "
            f"{'on' if kv.get('prefetch') else 'off'}"
        )
    if plan.backend == "ray" and s.replicas == 1:
        lines.append(f"  placement: {_ray_placement(s)}")
    for e in s.outputs:
        lines.append(
            f"  -> stage {e.to_stage}: {_connector(e, plan)} sends {_carries(e)}; tp {e.from_tp} -> {e.to_tp}"
        )
    for e in s.inputs:
        lines.append(
            f"  <- stage {e.from_stage}: {_connector(e, plan)} receives "
            f"{_carries(e)}; tp {e.from_tp} -> {e.to_tp}"
        )
    if s.payload.get("mode") == "async_chunk":
        lines.append(
            f"  chunks: {s.payload['chunk_size']} tokens, stall timeout {s.payload['stall_timeout']:g} s"
        )
    return lines


def _replica_lines(s: ResolvedStage, plan: ResolvedPipeline) -> list[str]:
    """A replicated stage's copies and where each goes (one line each)."""
    if s.replicas == 1:
        return []
    lines = [f"  replicas: {s.replicas}, each its own process; requests go to the least loaded"]
    for k in range(s.replicas):
        copy = s.for_replica(k)
        devices = f", devices {copy.devices}" if copy.devices is not None else ""
        where = "a process on this host (local backend)"
        if plan.backend == "ray":
            where = _ray_placement(copy)
            if not s.replica_placements:
                where += " (Ray spreads the replicas over the nodes that have it)"
        lines.append(f"    replica {k}: {where}{devices}")
    if plan.backend == "ray" and any(e.connector.name == AUTO_CONNECTOR for e in (*s.inputs, *s.outputs)):
        lines.append("    auto edges: picked per pair of replicas, by the nodes they land on")
    return lines


def _ray_placement(s: ResolvedStage) -> str:
    wants = ", ".join(f"{k}: {v:g}" for k, v in sorted((s.placement.get("resources") or {}).items()))
    return f"a Ray actor holding {wants or 'no resources'}"


def format_plan(plan: ResolvedPipeline) -> str:
    lines = [f"pipeline {plan.name!r}" + (f" ({plan.source})" if plan.source else "")]
    if plan.description:
        lines.append(f"  {plan.description}")
    lines.append(f"platform: {plan.platform}")
    for s in plan.stages:
        lines.extend(_stage_lines(s, plan))
    where = f"ray ({plan.ray_address or '--ray-address'})" if plan.backend == "ray" else "local (this host)"
    lines.append(f"backend: {where}")
    lines.append(
        f"runtime: request timeout {plan.request_timeout:g} s, shutdown timeout "
        f"{plan.shutdown_timeout:g} s"
        + (f", debug dumps in {plan.debug_dump_dir}" if plan.debug_dump_dir else "")
    )
    restarts = (
        f"up to {plan.max_restarts} per {plan.restart_window:g} s, backoff from {plan.restart_backoff:g} s"
        if plan.max_restarts
        else "off (max_restarts 0)"
    )
    lines.append(
        f"supervision: restarts {restarts}; stalled after {plan.heartbeat_timeout:g} s without a heartbeat"
    )
    return "\n".join(lines)


def plan_as_json(plan: ResolvedPipeline) -> dict[str, Any]:
    data = msgspec.to_builtins(plan)
    for s, out in zip(plan.stages, data["stages"]):
        if s.is_llm:
            out["runner_settings"] = runner_settings(s)
    return data


def _run(args: argparse.Namespace) -> int:
    try:
        plan = resolve(args.file, platform=args.platform)
        # LLM stages keep "no model" in the plan (run/serve fill it); their receivers' KV
        # geometry is read from the model those commands would use.
        plan = fill_kv_geometry(plan, default_model=args.model or tiny_model_name(args.arch))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan_as_json(plan), indent=2, sort_keys=True))
    else:
        print(format_plan(plan))
        print("OK")
    return 0
