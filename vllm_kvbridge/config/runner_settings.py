"""What a resolved stage hands to the code that runs it.

* :func:`kv_transfer_config_dict`: the stage's KV settings as the keyword dict of
  :class:`vllm_kvbridge.kv.config.KVTransferConfig` (``KVTransferConfig.from_dict``).
* :func:`runner_settings`: the dict an LLM stage receives in its ``kv_transfer_config`` as
  ``kv_connector_extra_config["kvbridge"]`` (read by ``RunnerSettings.from_vllm_config``).

These are the only two places that translate the YAML schema into the lower layers'
settings, so a renamed field changes here and nowhere else.
"""

from __future__ import annotations

from typing import Any

from vllm_kvbridge.config.resolve import ResolvedEdge, ResolvedStage


def _kv_edge(stage: ResolvedStage, role: str) -> ResolvedEdge | None:
    edges = stage.outputs if role == "sender" else stage.inputs
    return next((e for e in edges if e.kv), None)


def kv_transfer_config_dict(stage: ResolvedStage) -> dict[str, Any]:
    """``KVTransferConfig`` fields for ``stage`` (one KV edge per direction at most)."""
    kv = stage.kv_transfer
    out: dict[str, Any] = {
        "stage_id": stage.stage_id,
        "need_send_cache": bool(kv.get("need_send_cache")),
        "need_recv_cache": bool(kv.get("need_recv_cache")),
        "recv_timeout": float(kv.get("recv_timeout", 30.0)),
        "send_timeout": float(kv.get("send_timeout", 60.0)),
        "max_send_queue_bytes": int(kv.get("max_send_queue_bytes", 1 << 30)),
        "staging_bytes": kv.get("staging_bytes"),
        "enable_kv_async_prefetch": bool(kv.get("prefetch", True)) and bool(kv.get("need_recv_cache")),
    }
    expect = {k: v for k, v in (kv.get("expect") or {}).items() if v is not None}
    if expect and kv.get("need_recv_cache"):
        out["expect_kv"] = expect
    if int((stage.diffusion or {}).get("num_ranks", 1)) > 1:
        # Rank 0 receives every head and hands the KV to the other rank (LEADER -> FOLLOWER).
        out["distribution"] = "leader"
    send, recv = _kv_edge(stage, "sender"), _kv_edge(stage, "receiver")
    edge = send or recv
    if send is not None:
        out["to_stage"] = send.to_stage
    if recv is not None:
        out["from_stage"] = recv.from_stage
    if edge is not None:
        out.update(
            from_tp=edge.from_tp,
            to_tp=edge.to_tp,
            connector=edge.connector.name,
            connector_config=dict(edge.connector.config),
        )
    return out


def _payload_edge(e: ResolvedEdge) -> dict[str, Any]:
    # What the sending and the receiving end of a payload edge are both told about it.
    connector = e.connector
    return {"mode": e.payload_mode, "connector": connector.name, "connector_config": dict(connector.config)}


def runner_settings(stage: ResolvedStage) -> dict[str, Any]:
    """The kvbridge settings of an LLM stage (``RunnerSettings.from_dict``; see the module doc)."""
    kv = stage.kv_transfer
    payload = stage.payload
    capture = set(payload.get("capture", []))
    outputs = [
        {
            "to_stage": e.to_stage,
            **_payload_edge(e),
            "chunk_size": int(payload.get("chunk_size", 16)),
            "send_timeout_s": float(payload.get("send_timeout", 60.0)),
        }
        for e in stage.outputs
        if e.payload_mode != "none"
    ]
    inputs = [
        {
            "from_stage": e.from_stage,
            **_payload_edge(e),
            "recv_timeout_s": float(payload.get("recv_timeout", 30.0)),
            "stall_timeout_s": float(payload.get("stall_timeout", 30.0)),
            "feed": payload.get("feed", "prompt_embeds"),
        }
        for e in stage.inputs
        if e.payload_mode != "none"
    ]
    settings: dict[str, Any] = {
        "stage_id": stage.stage_id,
        "kv_send": {
            "trigger": kv.get("trigger", "on_finish"),
            "trigger_token_id": kv.get("trigger_token_id"),
            "stop_after_transfer": bool(kv.get("stop_after_transfer")),
        },
        "payload": {
            "capture_hidden_states": "hidden_states" in capture and bool(outputs),
            "capture_token_ids": "token_ids" in capture,
            "custom_process_next_stage_input_func": payload.get("custom_process_next_stage_input_func"),
            "outputs": outputs,
            "inputs": inputs,
        },
    }
    if kv.get("need_send_cache") or kv.get("need_recv_cache"):
        settings["kv_transfer"] = kv_transfer_config_dict(stage)
    if stage.runner_cls:
        settings["runner_cls"] = stage.runner_cls
    return settings
