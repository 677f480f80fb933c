"""The orchestrator's view of one stage process, and how a run's stages are prepared.

:class:`StageHandle` is what :class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` holds
per spawned stage (process, log, readiness, failure); :func:`with_run_namespaces` gives a
run's shared-memory and Mooncake-store edges their own namespace; :func:`with_run_curve_keys`
gives a run's ZMQ edges bound beyond loopback their own CURVE keypair; :func:`log_tail` /
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


ZMQ_CONNECTOR = "ZmqConnector"
CURVE_ENV_PREFIX = "KVBRIDGE_CURVE_"


def binds_beyond_loopback(config: dict[str, Any]) -> bool:
    """Whether a ZMQ connector with ``config`` listens on more than this host's loopback."""
    host = str(config.get("host", "127.0.0.1"))
    return not (host.startswith("127.") or host in ("localhost", "::1"))


def with_run_curve_keys(
    stages: list[ResolvedStage], external: frozenset[int] = frozenset()
) -> list[ResolvedStage]:
    """CURVE on by default where a ZMQ edge binds beyond loopback (issue 15): one keypair per
    such edge and run, in the environment of the edge's two stages (``curve_keys_env``; see
    :mod:`vllm_kvbridge.connectors.zmq_p2p`), so a peer without it is refused. Edges whose
    either end has keys of its own, or that touch an ``external`` stage, are left alone."""
    import json

    import zmq

    # Each end of an edge may name its own connector (output_connectors / input_connectors).
    senders = {(e.from_stage, e.to_stage): e.connector for s in stages for e in s.outputs}
    receivers = {(e.from_stage, e.to_stage): e.connector for s in stages for e in s.inputs}
    keys: dict[tuple[int, int], str] = {}
    for edge, sender in senders.items():
        connectors = [sender] + ([receivers[edge]] if edge in receivers else [])
        if (
            all(c.name == ZMQ_CONNECTOR for c in connectors)
            and binds_beyond_loopback(sender.config)
            and not any(k.startswith("curve_") for c in connectors for k in c.config)
            and not set(edge) & external
        ):
            public, secret = zmq.curve_keypair()
            keys[edge] = json.dumps({"public": public.decode(), "secret": secret.decode()})
    if not keys:
        return stages

    def fix(e: Any, env: dict[str, str]) -> Any:
        pair = keys.get((e.from_stage, e.to_stage))
        if pair is None:
            return e
        var = f"{CURVE_ENV_PREFIX}{e.from_stage}_{e.to_stage}"
        env[var] = pair
        connector = msgspec.structs.replace(e.connector, config={**e.connector.config, "curve_keys_env": var})
        return msgspec.structs.replace(e, connector=connector)

    out = []
    for s in stages:
        env = dict(s.env)
        inputs = [fix(e, env) for e in s.inputs]
        outputs = [fix(e, env) for e in s.outputs]
        out.append(msgspec.structs.replace(s, inputs=inputs, outputs=outputs, env=env))
    return out
