"""What a request's parameters must satisfy before it enters a pipeline.

Checked by the orchestrator when a request is submitted, so a request the stages could not
serve faithfully fails at once with a clear message instead of losing data later.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

from vllm_kvbridge.pipeline.cfg import check_request_id
from vllm_kvbridge.pipeline.engines import ABORTED_KEEP_S


def check_new_id(rid: str, in_use: Container[str], ended_in_error: Container[str]) -> None:
    """Refuse (``ValueError``) an id that is malformed, in use, or ended in error lately."""
    check_request_id(rid)
    if rid in in_use:
        raise ValueError(f"request id {rid!r} is already in use")
    if rid in ended_in_error:
        raise ValueError(
            f"request id {rid!r} ended in error less than {ABORTED_KEEP_S:.0f} s ago (its"
            " stages still drop what arrives late for it): retry under a new id"
        )


def check_sampling_params(
    plan: Any,
    sampling_params: Mapping[str, Any] | None,
    stage_params: Mapping[int, Mapping[str, Any]] | None = None,
) -> None:
    """Refuse parameters a stage that sends KV or payloads cannot honour (``ValueError``).

    ``n > 1`` (several samples per request): vLLM runs the samples as child requests that
    share the request's transfer id, so each would claim the same transfer keys and only
    one could be delivered. (``sampling_params`` apply to the entry stage, ``stage_params``
    to the stage they name, both over the stage's ``default_sampling_params``.)
    """
    for stage in plan.stages:
        if not stage.is_llm or not stage.outputs:
            continue
        params = {**stage.default_sampling_params, **(stage_params or {}).get(stage.stage_id, {})}
        if stage.stage_id == plan.entry_stage.stage_id:
            params.update(sampling_params or {})
        n = params.get("n", 1)
        if n is not None and n != 1:
            raise ValueError(
                f"n={n!r} is not supported by stage {stage.stage_id} ({stage.kind}), which sends "
                "KV or payloads to the next stage: each sample would need its own transfer; "
                "submit the prompt n times instead"
            )
