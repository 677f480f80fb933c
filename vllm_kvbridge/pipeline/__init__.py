"""The orchestrator and the stage processes (see :mod:`vllm_kvbridge.pipeline.orchestrator`)."""

from vllm_kvbridge.pipeline.orchestrator import (
    Pipeline,
    PipelineError,
    RequestError,
    RequestResult,
    StageError,
    StageRecord,
)

__all__ = ["Pipeline", "PipelineError", "RequestError", "RequestResult", "StageError", "StageRecord"]
