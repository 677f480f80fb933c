"""What a request's parameters must satisfy before it enters a pipeline.

Checked by the orchestrator when a request is submitted, so a request the stages could not
serve faithfully fails at once with a clear message instead of losing data later.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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
