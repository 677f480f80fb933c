"""What an LLM stage's workers report of their sends, read for the next stage.

Every rank answers ``kvbridge_sender_info`` (``StageRuntime.sender_info``,
:mod:`vllm_kvbridge.runner.stage_runtime`): its KV sends' put metadata per transfer id
and, on rank 0, its payload senders' receiver info per peer stage. The stage engine
(:mod:`vllm_kvbridge.pipeline.llm_engine`) merges them into what the orchestrator
forwards to the consumer.
"""

from __future__ import annotations

from typing import Any

from vllm_kvbridge.runner.transfer_status import is_failed


def kv_send_owed(output: Any) -> bool:
    """Whether our connector told vLLM, when ``output``'s request finished, that it sends its KV."""
    params = getattr(output, "kv_transfer_params", None) or {}
    return params.get("kvbridge_kv") == "submitted"


def kv_send_refused(output: Any) -> str | None:
    """Why our connector refused, when ``output``'s request finished, to send its KV (a
    ``failed: ...`` status; e.g. a sliding window moved past the trigger's tokens), or None."""
    params = getattr(output, "kv_transfer_params", None) or {}
    status = params.get("kvbridge_kv")
    return str(status) if status is not None and is_failed(status) else None


def merge_kv_info(per_rank: list[dict[str, Any]], rid: str) -> dict[str, Any]:
    """Sender info of one request over all ranks, in the KV manager's ``keys``/``ranks`` form."""
    keys: dict[str, Any] = {}
    ranks: dict[str, Any] = {}
    heads: int | None = None
    for info in per_rank:
        got = (info.get("kv") or {}).get(rid) or {}
        keys.update(got.get("keys") or {})
        ranks.update(got.get("ranks") or {})
        heads = got.get("num_kv_heads", heads)
    out: dict[str, Any] = {}
    if keys:
        out["keys"] = keys
    if ranks:
        out["ranks"] = ranks
    if heads is not None:
        # Lets a receiver with TP > 1 on both ends route heads without configuring them.
        out["num_kv_heads"] = heads
    return out


def payload_meta(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Peer stage -> what its receiver needs from this stage's payload sender (rank 0's)."""
    out: dict[str, Any] = {}
    for info in per_rank:
        out.update({str(k): v for k, v in (info.get("payload") or {}).items()})
    return out


__all__ = ["kv_send_owed", "kv_send_refused", "merge_kv_info", "payload_meta"]
