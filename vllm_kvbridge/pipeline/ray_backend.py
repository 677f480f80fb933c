"""The Ray backend: each stage in a Ray actor, on the node Ray picks.

``vllm-kvbridge run|serve --ray-address auto|HOST:PORT`` (or ``runtime.backend: ray``)
joins an existing Ray cluster (``ray start --head`` / ``ray start --address``) and gives
every stage (every replica of a stage with ``replicas: N``) one :class:`StageHost` actor
that holds its ``placement.resources`` (``GPU``, ``CPU``, custom node resources such as
``node_a: 1``; a placement per replica, or one for all, whose actors Ray then spreads over
the nodes that have them) for as long as it runs. The actor starts the same stage process the local backend
starts (``python -m vllm_kvbridge.pipeline.stage_process``: its vLLM engine and TP ranks
run there, on that node) and watches it; the orchestrator drives it through
:class:`RayStageProcess`, which has the local process's interface, so supervision,
restarts and shutdown are the same code on both backends.

What crosses nodes: the control socket binds the driver node's address (Ray's
``get_node_ip_address``) and every stage connects to it with a CURVE keypair of its own
(:mod:`vllm_kvbridge.pipeline.control_auth`): the orchestrator issues it per stage process
and passes it in the ``env`` of the actor's :meth:`StageHost.start` call, and the actor
writes it on the stage process's stdin (``start_stage_process``), never in its environment
or argv; an edge's data goes over the connector its config names, or the one
``connector: auto`` picks from the placement (:mod:`vllm_kvbridge.config.locality`). A
stage's output goes to a log on its own node (``<tmp>/kvbridge-<run>/stage_<id>.log``); its
tail is read through the actor for error reports, and the whole log is copied into the run's log
directory when the pipeline stops.

Failure contract: a stage whose actor dies (killed, its node removed) is lost like a
process that exited: its requests fail naming it and supervision restarts it on the same
node (an actor pinned there; if the node is gone, that restart fails and, once restarts
are spent, so does the pipeline). The stage process watches its parent, the actor: when the
actor dies, the process group ends itself. Closing the pipeline stops every stage, reaps
each node's leftovers through its actors and kills every actor, which frees its resources.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from vllm_kvbridge.config.locality import NodeInfo, shm_identity
from vllm_kvbridge.config.resolve import ResolvedStage
from vllm_kvbridge.pipeline.results import PipelineError, StageError
from vllm_kvbridge.pipeline.stage_handles import (
    LOG_TAIL_LINES,
    LocalStageProcess,
    StageHandle,
    exit_cause,
    log_tail,
    reap_run_edges,
    stage_env,
    start_stage_process,
)

#: How long one call to a live actor may take (a kill waits for the group: 5 s there).
ACTOR_CALL_S = 30.0
#: How long a (re)started stage's actor may take to come up on its node.
ACTOR_START_S = 60.0
#: Bytes of a remote stage's log copied into the run's log directory at the end.
LOG_COPY_BYTES = 8 << 20


class StageHost:
    """The actor of one stage on its node: starts the stage process, watches it, kills it.

    Methods are called from the orchestrator, some while :meth:`wait` blocks (the actor is
    threaded: ``max_concurrency``)."""

    def __init__(self, run_id: str, log_name: str) -> None:
        self._dir = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / f"kvbridge-{run_id}"
        self._dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._dir / log_name
        # The stage process is a child of this actor: driven here as the local backend
        # drives its children.
        self._proc: LocalStageProcess | None = None

    def node(self) -> tuple[str, str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), shm_identity()

    def start(
        self, stage_json: bytes, address: str, env: dict[str, str], heartbeat_s: float
    ) -> tuple[int, str]:
        """Start the stage process; ``env`` holds its control-plane credentials, which reach
        it on stdin (:func:`start_stage_process`). Returns its pid and log path here."""
        stage = msgspec.json.decode(stage_json, type=ResolvedStage)
        full_env = stage_env(stage, {**os.environ, **env})
        popen = start_stage_process(stage_json, stage.stage_id, address, self.log_path, full_env, heartbeat_s)
        self._proc = LocalStageProcess(popen, self.log_path)
        return self._proc.pid, str(self.log_path)

    def wait(self) -> int:
        assert self._proc is not None
        return self._proc.wait()

    def terminate(self) -> None:
        if self._proc is not None:
            self._proc.terminate_group()

    def kill(self, known: list[str]) -> list[str]:
        if self._proc is None:
            return []
        removed = self._proc.kill_group(set(known))
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)  # reap it
        return removed

    def mapped_shm(self) -> list[str]:
        return sorted(self._proc.mapped_shm()) if self._proc is not None else []

    def log_tail(self, lines: int) -> str:
        return log_tail(self.log_path, lines)

    def read_log(self, max_bytes: int) -> bytes:
        with contextlib.suppress(OSError), open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read()
        return b""

    def reap(self, stages_json: bytes) -> None:
        reap_run_edges(msgspec.json.decode(stages_json, type=list[ResolvedStage]))


@functools.cache
def _actor_class() -> Any:
    """:class:`StageHost` as a Ray actor class (made once: Ray exports it to the cluster)."""
    import ray

    return ray.remote(StageHost)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


class RayStageProcess:
    """A stage process started by a :class:`StageHost` actor, driven from the orchestrator."""

    def __init__(self, actor: Any, pid: int, node: NodeInfo, log: str) -> None:
        self.actor, self.pid, self.node, self.log = actor, pid, node, log
        self._wait_ref = actor.wait.remote()
        self._code: int | None = None
        self.gone: str | None = None  # why the actor is gone (it died with its process)

    def poll(self) -> int | None:
        if self._code is None:
            import ray

            ready, _ = ray.wait([self._wait_ref], timeout=0)
            if ready:
                try:
                    self._code = ray.get(ready[0])
                except ray.exceptions.RayError as exc:  # the actor (or its node) died
                    self.gone = _first_line(exc)
                    self._code = -signal.SIGKILL
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        import ray

        ray.wait([self._wait_ref], timeout=timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"stage pid {self.pid}", timeout or 0.0)
        return code

    def _call(self, method: str, *args: Any, timeout: float = ACTOR_CALL_S) -> Any:
        """A call to the actor; None when it is gone or does not answer in ``timeout``."""
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            self.gone = self.gone or _first_line(exc)
            return None

    def terminate_group(self) -> None:
        self._call("terminate", timeout=5.0)

    def kill_group(self, known: set[str] | frozenset[str] = frozenset()) -> list[str]:
        return self._call("kill", sorted(known)) or []

    def mapped_shm(self) -> set[str]:
        return set(self._call("mapped_shm") or ())

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        tail = self._call("log_tail", lines, timeout=10.0) if self.gone is None else None
        if tail is None:
            return f"its Ray actor on node {self.node.ip} is gone ({self.gone}); log there: {self.log}"
        return tail

    def exit_reason(self, code: int, tail: str) -> str:
        # An actor that died (its node removed, its worker killed) is the cause; the exit
        # signal is only how Ray reports it.
        return f"its Ray actor is gone: {self.gone}" if self.gone else exit_cause(code, tail)


class RayBackend:
    """Stages as Ray actors (see the module docstring)."""

    def __init__(self, address: str, run_id: str) -> None:
        try:
            import ray
        except ImportError:
            raise PipelineError(
                "the Ray backend needs Ray: pip install 'vllm-kvbridge[ray]' (ray[default]==2.60.0)"
            ) from None
        self._ray = ray
        self._own_init = not ray.is_initialized()
        if self._own_init:
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError as exc:
                raise PipelineError(f"cannot join the Ray cluster at {address!r}: {exc}") from None
        self._run_id = run_id
        # keyed by (stage id, replica)
        self._placed: dict[tuple[int, int], Any] = {}  # actor placed, not started yet
        self._actors: dict[tuple[int, int], list[tuple[Any, Path]]] = {}  # every actor, log copy
        self._nodes: dict[tuple[int, int], NodeInfo] = {}
        self._closed = False

    def control_host(self) -> str:
        return self._ray.util.get_node_ip_address()

    def _new_actor(self, stage: ResolvedStage, node_id: str | None = None) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        resources = dict(stage.placement.get("resources") or {})
        options: dict[str, Any] = {
            "num_cpus": resources.pop("CPU", 0),
            "num_gpus": resources.pop("GPU", 0),
            "resources": resources,
            "max_concurrency": 8,
            "name": f"kvbridge-{self._run_id}-stage-{stage.stage_id}-r{stage.replica}-{time.monotonic_ns()}",
        }
        if stage.placement.get("runtime_env"):
            options["runtime_env"] = stage.placement["runtime_env"]
        if node_id is not None:  # a restart: where its edges were chosen for
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        elif stage.replicas > 1:  # replicas spread over the nodes their placement allows
            options["scheduling_strategy"] = "SPREAD"
        log_name = f"stage_{stage.stage_id}.log"
        if stage.replicas > 1:
            log_name = f"stage_{stage.stage_id}.replica{stage.replica}.log"
        return _actor_class().options(**options).remote(self._run_id, log_name)

    def place(self, stages: Sequence[ResolvedStage]) -> dict[tuple[int, int], NodeInfo]:
        ray = self._ray
        actors = {(s.stage_id, s.replica): self._new_actor(s) for s in stages}
        self._placed.update(actors)
        refs = {key: actor.node.remote() for key, actor in actors.items()}
        for s in stages:
            key = (s.stage_id, s.replica)
            try:
                node_id, ip, shm = ray.get(refs[key], timeout=s.start_timeout)
            except ray.exceptions.GetTimeoutError:
                wants = s.placement.get("resources") or {}
                raise StageError(
                    s.stage_id,
                    s.kind,
                    f"not placed after {s.start_timeout:.0f} s (start_timeout): no Ray node has"
                    f" the resources of placement.resources {wants}",
                    replica=s.named_replica,
                ) from None
            except ray.exceptions.RayError as exc:
                raise StageError(
                    s.stage_id, s.kind, f"its Ray actor failed: {_first_line(exc)}", replica=s.named_replica
                ) from None
            self._nodes[key] = NodeInfo(node_id, ip, shm)
        return dict(self._nodes)

    def spawn(
        self, stage: ResolvedStage, address: str, log_path: Path, env: Mapping[str, str], heartbeat_s: float
    ) -> StageHandle:
        ray = self._ray
        key = (stage.stage_id, stage.replica)
        node = self._nodes[key]
        actor = self._placed.pop(key, None) or self._new_actor(stage, node.node_id)
        self._actors.setdefault(key, []).append((actor, log_path))
        now = time.monotonic()
        try:
            env = {**dict(env), "KVBRIDGE_RAY_NODE_ID": node.node_id}
            ref = actor.start.remote(msgspec.json.encode(stage), address, env, heartbeat_s)
            pid, log = ray.get(ref, timeout=ACTOR_START_S)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
            proc = _NotStarted(
                node, f"its Ray actor could not start it on node {node.ip}: {_first_line(exc)}"
            )
            return StageHandle(stage, proc, log_path, now, last_seen=now)
        return StageHandle(stage, RayStageProcess(actor, pid, node, log), log_path, now, last_seen=now)

    def reap(self, stages: Sequence[ResolvedStage]) -> None:
        """Every node with a live actor reaps the run's edges there (this one too)."""
        ray = self._ray
        payload = msgspec.json.encode(list(stages))
        refs = [runs[-1][0].reap.remote(payload) for runs in self._actors.values()]
        deadline = time.monotonic() + ACTOR_CALL_S
        for ref in refs:  # one by one: a dead actor's error must not cut the others short
            with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        reap_run_edges(stages)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        for runs in self._actors.values():
            for actor, log_path in runs:
                with contextlib.suppress(ray.exceptions.RayError, ray.exceptions.GetTimeoutError, OSError):
                    data = ray.get(actor.read_log.remote(LOG_COPY_BYTES), timeout=10.0)
                    with open(log_path, "ab") as f:
                        f.write(data)
        for actor in [a for runs in self._actors.values() for a, _ in runs] + list(self._placed.values()):
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(actor)
        self._actors.clear()
        self._placed.clear()
        if self._own_init:
            ray.shutdown()


class _NotStarted:
    """The process of a stage whose actor could not start it: it counts as exited."""

    pid = -1

    def __init__(self, node: NodeInfo, why: str) -> None:
        self.node, self.log, self.why = node, "", why

    def poll(self) -> int:
        return 1

    def wait(self, timeout: float | None = None) -> int:
        return 1

    def terminate_group(self) -> None:
        pass

    def kill_group(self, known: set[str] | frozenset[str] = frozenset()) -> list[str]:
        return []

    def mapped_shm(self) -> set[str]:
        return set()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return self.why
