"""The orchestrator's view of one stage process, and how a run's stages are prepared.

:class:`StageHandle` is what :class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` holds
per spawned stage (process, log, readiness, failure); :func:`with_run_namespaces` gives a
run's shared-memory and Mooncake-store edges their own namespace; :func:`log_tail` /
:func:`last_error_line` read a stage's log for error reports.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from vllm_kvbridge.config.resolve import ResolvedConnector, ResolvedStage
from vllm_kvbridge.connectors.keys import edge_name
from vllm_kvbridge.pipeline.results import StageError

#: Lines of a stage's log quoted in its error.
LOG_TAIL_LINES = 15


@dataclass
class StageHandle:
    stage: ResolvedStage
    proc: subprocess.Popen
    log_path: Path
    spawned: float
    ready_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    failure: StageError | None = None

    @property
    def label(self) -> str:
        return f"stage {self.stage.stage_id} ({self.stage.kind})"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def last_error_line(tail: str) -> str:
    for line in reversed(tail.splitlines()):
        if line.strip() and not line.startswith(" "):
            return line.strip()
    return ""


#: Connectors whose names (segments, store keys) live in a namespace shared by every run on
#: the host / store: each run gets its own unless the config names one.
RUN_NAMESPACED = ("SharedMemoryConnector", "MooncakeStoreConnector")


def with_run_namespaces(
    stage: ResolvedStage, run_id: str, external: frozenset[int] = frozenset()
) -> ResolvedStage:
    """Give shared-memory and Mooncake-store edges a namespace unique to this run, so the
    orchestrator can sweep exactly this run's segments after a crash and two runs (on one
    host, or sharing one Mooncake master) never collide on a request id. Edges touching an
    ``external`` stage (a server started from the config before this run) keep theirs."""

    def fix(c: ResolvedConnector, a: int, b: int) -> ResolvedConnector:
        if c.name not in RUN_NAMESPACED or "namespace" in c.config or {a, b} & external:
            return c
        return msgspec.structs.replace(c, config={**c.config, "namespace": f"{run_id}-{edge_name(a, b)}"})

    inputs = [
        msgspec.structs.replace(e, connector=fix(e.connector, e.from_stage, e.to_stage)) for e in stage.inputs
    ]
    outputs = [
        msgspec.structs.replace(e, connector=fix(e.connector, e.from_stage, e.to_stage))
        for e in stage.outputs
    ]
    return msgspec.structs.replace(stage, inputs=inputs, outputs=outputs)
