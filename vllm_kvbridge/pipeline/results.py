"""What a pipeline run produces per request, and the errors it raises.

Plain data, no processes: :class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` fills
these in (and re-exports them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_kvbridge.errors import KVBridgeError
from vllm_kvbridge.pipeline import messages as m

__all__ = [
    "PipelineError",
    "RequestError",
    "RequestResult",
    "StageError",
    "StageRecord",
    "StageRecovering",
    "stage_name",
]


class PipelineError(KVBridgeError):
    """The pipeline cannot serve (a stage failed or the pipeline is closed)."""


def stage_name(stage_id: int, kind: str, replica: int | None = None) -> str:
    """``stage 1 (diffusion)``, and ``replica 1`` after it for a replica of a replicated stage."""
    return f"stage {stage_id} ({kind})" + (f" replica {replica}" if replica is not None else "")


class StageError(PipelineError):
    """A stage failed to start or died; ``stage_id`` and ``error`` say which and why;
    ``replica``: which replica of a stage that has several (else None)."""

    def __init__(
        self, stage_id: int, kind: str, error: str, log_tail: str = "", replica: int | None = None
    ) -> None:
        self.stage_id, self.kind, self.error, self.log_tail = stage_id, kind, error, log_tail
        self.replica = replica
        super().__init__(f"{stage_name(stage_id, kind, replica)} failed: {error}")


class StageRecovering(PipelineError):
    """A lost stage is being restarted: no new request is started until it is ready
    (``error`` says why it was lost)."""

    def __init__(self, error: StageError) -> None:
        self.error = error
        name = stage_name(error.stage_id, error.kind, error.replica)
        super().__init__(f"{name} is restarting after: {error.error}")


class RequestError(PipelineError):
    """One or more requests failed; ``results`` holds every result, failed ones with ``error``."""

    def __init__(self, results: list[RequestResult]) -> None:
        self.results = results
        failed = [r for r in results if r.error]
        super().__init__("; ".join(f"request {r.request_id}: {r.error}" for r in failed))


@dataclass
class StageRecord:
    stage_id: int
    kind: str
    submitted: float  # time.time() when the orchestrator sent it
    done: float = 0.0
    started: float = 0.0  # as the stage reported
    finished: float = 0.0
    output: dict[str, Any] = field(default_factory=dict)
    #: time.time() of the stage's first and last token (a stage that makes no tokens, such
    #: as diffusion: when it produced its output); one clock for the stages of a host
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    #: the node the stage ran it on (a Ray node id; ``local`` on the local backend)
    node_id: str = "local"
    #: which replica of the stage took it (``StageSpec.replicas``; 0 without replicas)
    replica: int = 0

    @property
    def wall_s(self) -> float:
        return max(0.0, self.done - self.submitted)


@dataclass
class RequestResult:
    """Everything one request produced, stage by stage."""

    request_id: str
    prompt: str
    stages: list[StageRecord] = field(default_factory=list)
    transfers: list[m.TransferStat] = field(default_factory=list)
    text: str | None = None
    token_ids: list[int] | None = None
    image: Any = None  # numpy [3, H, W] float32 in [0, 1] when the last stage is diffusion
    audio: Any = None  # numpy [n] float32 in [-1, 1] when the last stage is a vocoder
    sample_rate: int | None = None  # of ``audio`` (Hz)
    error: str | None = None
    finished: bool = False
    #: The stage whose loss (crash, stall) failed it, when that is why it failed.
    lost_stage: int | None = None

    def edge_stats(self) -> dict[tuple[int, int, str, str], m.TransferStat]:
        """(from, to, what, purpose) -> the transfer, as the receiving side measured it when it
        reported; ``purpose`` is ``"kv"`` for the primary KV, else the CFG companion's."""
        out: dict[tuple[int, int, str, str], m.TransferStat] = {}
        for side in ("sender", "receiver"):
            for t in self.transfers:
                if t.side == side:
                    out[(t.from_stage, t.to_stage, t.what, t.purpose)] = t
        return out

    def edge_totals(self) -> dict[tuple[int, int, str, str], tuple[int, float]]:
        """(from, to, what, purpose) -> (bytes, seconds) of :meth:`edge_stats`."""
        return {key: (t.nbytes, t.seconds) for key, t in self.edge_stats().items()}

    def handoff_s(self, from_stage: int, to_stage: int) -> float | None:
        """Seconds from ``from_stage``'s last token to ``to_stage`` holding its whole payload
        (the stage-to-stage handoff; one clock for the stages of a host); None when unknown."""
        producer = next((s for s in self.stages if s.stage_id == from_stage), None)
        ready = [
            t.ready_at
            for t in self.transfers
            if (t.from_stage, t.to_stage) == (from_stage, to_stage) and t.ready_at > 0
        ]
        if producer is None or not producer.last_token_at or not ready:
            return None
        return max(ready) - producer.last_token_at
