"""Stage configs: YAML schema, loading, validation and per-stage resolution.

Import-light on purpose (no vLLM, no connector modules), so ``check-config`` and unit
tests run in milliseconds.
"""

from vllm_kvbridge.config.loader import expand_env, load_spec, spec_from_dict
from vllm_kvbridge.config.resolve import (
    ResolvedConnector,
    ResolvedEdge,
    ResolvedPipeline,
    ResolvedStage,
    resolve,
    resolve_spec,
)
from vllm_kvbridge.config.schema import (
    ConnectorSpec,
    DiffusionSpec,
    EdgeSpec,
    KVTransferSpec,
    PayloadSpec,
    PipelineSpec,
    RuntimeSpec,
    StageSpec,
)

__all__ = [
    "ConnectorSpec",
    "DiffusionSpec",
    "EdgeSpec",
    "KVTransferSpec",
    "PayloadSpec",
    "PipelineSpec",
    "ResolvedConnector",
    "ResolvedEdge",
    "ResolvedPipeline",
    "ResolvedStage",
    "RuntimeSpec",
    "StageSpec",
    "expand_env",
    "load_spec",
    "resolve",
    "resolve_spec",
    "spec_from_dict",
]
