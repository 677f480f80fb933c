"""The orchestrator's view of one stage process, and how a run's stages are prepared.

:class:`StageHandle` is what :class:`~vllm_kvbridge.pipeline.orchestrator.Pipeline` holds
per spawned stage process (process, log, readiness, last heartbeat, failure). Its process
is a :class:`StageProcess`: :class:`LocalStageProcess` here (a child of the orchestrator,
started by :func:`spawn_stage`), or a process a Ray actor started on its node
(:mod:`vllm_kvbridge.pipeline.ray_backend`). :func:`kill_stage_group` ends one for good on
its host, removing the shared memory its vLLM engine could not; :func:`with_run_namespaces` gives a
run's shared-memory and Mooncake-store edges their own namespace; :func:`with_run_curve_keys`
gives a run's ZMQ edges bound beyond loopback their own CURVE keypair; :func:`log_tail`
reads a stage's log and :func:`exit_cause` says why its process exited, for error reports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from vllm_kvbridge.config.locality import ROUTED, NodeInfo, local_node, routed_config
from vllm_kvbridge.config.resolve import ResolvedConnector, ResolvedStage
from vllm_kvbridge.connectors import shm_owners
from vllm_kvbridge.connectors.keys import edge_name
from vllm_kvbridge.pipeline.control_auth import credentials_from
from vllm_kvbridge.pipeline.results import StageError, stage_name
from vllm_kvbridge.procfs import group_pids, state

logger = logging.getLogger(__name__)

#: Lines of a stage's log quoted in its error.
LOG_TAIL_LINES = 15


class RunLogDir:
    """Where a run's stage logs go: the caller's directory (always kept), or a temporary one
    the run makes itself. That one is removed at :meth:`close` after a clean run, and kept
    when something went wrong, where its logs are what explains it."""

    def __init__(self, given: str | Path | None, run_id: str) -> None:
        self.own = given is None
        self.run_id = run_id
        #: None until :meth:`ensure` for the run's own directory (a run never started makes none)
        self.path: Path | None = None if given is None else Path(given)

    def ensure(self) -> Path:
        import tempfile

        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix=f"kvbridge-{self.run_id}-"))
        self.path.mkdir(parents=True, exist_ok=True)
        return self.path

    def close(self, *, clean: bool) -> bool:
        """Remove the run's own directory after a ``clean`` run; True when it is kept."""
        if not self.own or self.path is None:
            return False
        if clean:
            import shutil

            shutil.rmtree(self.path, ignore_errors=True)
            return False
        return self.path.exists()


class StageProcess(Protocol):
    """One stage's process as the orchestrator drives it, wherever it runs."""

    #: its pid on its host (the stage's messages carry it)
    pid: int
    #: where it runs (``log`` is where its output goes there)
    node: NodeInfo
    log: str

    def poll(self) -> int | None:
        """Its exit status once it ended (a negative signal number), else None."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to end; ``subprocess.TimeoutExpired`` after ``timeout``."""

    def terminate_group(self) -> None:
        """SIGTERM its process group."""

    def kill_group(self, known: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """:func:`kill_stage_group` on its host."""

    def mapped_shm(self) -> set[str]:
        """:func:`shm_mapped_by_group` of its group, on its host."""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last lines of its output (or why they cannot be read)."""

    def exit_reason(self, code: int, tail: str) -> str:
        """Why it ended with ``code``, in a few words (its signal, its log's error, or what
        took the host that ran it)."""


class LocalStageProcess:
    """A stage process that is a child of the orchestrator, in a session of its own."""

    def __init__(self, popen: subprocess.Popen, log_path: Path) -> None:
        self.popen, self.pid = popen, popen.pid
        self.node, self.log, self.log_path = local_node(), str(log_path), log_path

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def terminate_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGTERM)

    def kill_group(self, known: set[str] | frozenset[str] = frozenset()) -> list[str]:
        return kill_stage_group(self.pid, known)

    def mapped_shm(self) -> set[str]:
        return shm_mapped_by_group(self.pid)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def exit_reason(self, code: int, tail: str) -> str:
        return exit_cause(code, tail)


@dataclass
class StageHandle:
    stage: ResolvedStage
    proc: StageProcess
    log_path: Path
    spawned: float
    ready_at: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    failure: StageError | None = None
    #: ``time.monotonic()`` of its last message (a heartbeat or any other).
    last_seen: float = 0.0
    #: ``time.monotonic()`` since which its engine made no progress, as its latest heartbeat
    #: said (0.0: it does; :mod:`vllm_kvbridge.pipeline.liveness`), and why.
    stalled_since: float = 0.0
    stall: str = ""
    #: The orchestrator gave it up (it died, failed or stalled, and was killed).
    lost: bool = False
    #: /dev/shm names its process group mapped when it became ready (vLLM's own), to
    #: remove once it is killed: a dead group's maps cannot be read any more.
    shm_names: set[str] = field(default_factory=set)
    #: Its connectors' counters, as its last ``StageStats`` said (this process's only).
    counters: dict[str, float] = field(default_factory=dict)
    #: The control-plane key issued for this process (``control_auth.StageCredentials``):
    #: what it sends is believed only under this key, and reaches it at ``route``.
    control_key: str = ""
    route: bytes = b""

    @property
    def label(self) -> str:
        return stage_name(self.stage.stage_id, self.stage.kind, self.stage.named_replica)

    def error(self, error: str, log_tail: str = "") -> StageError:
        """A :class:`StageError` naming this process's stage (and replica)."""
        s = self.stage
        return StageError(s.stage_id, s.kind, error, log_tail, s.named_replica)


def stage_env(stage: ResolvedStage, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` (the host's environment and the pipeline's) with what ``stage`` sets."""
    env = {**env, **stage.env}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # vLLM-CPU pins each engine's OpenMP threads to cores ("auto"): the stages of one host
    # are several engines, each pinned to the same cores, and a worker busy-polls its
    # message queue whenever its engine has a request. A thinker pinned beside the spinning
    # worker of a talker waiting for its rows made 4 tokens in over 30 s on 2 cores (the
    # same run unpinned: a few seconds in all). Unpinned, the OS places the threads; a
    # user's own setting wins. (GPU engines do not read it.)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    if stage.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = stage.devices
    return env


def start_stage_process(
    stage_json: bytes, stage_id: int, address: str, log_path: Path, env: Mapping[str, str], heartbeat_s: float
) -> subprocess.Popen:
    """Start a stage process (in a session of its own: killable as a whole group), its
    :class:`ResolvedStage` (``stage_json``) on stdin, its output appended to ``log_path``.
    The process belongs to the caller: the orchestrator, or a Ray actor on another node.

    ``env`` carries the process's control-plane credentials (``control_auth.CREDENTIALS_ENV``,
    required): they are taken out of its environment and written on its stdin ahead of its
    config, so that neither ``ps`` (argv) nor its children (which inherit the environment,
    vLLM's engine core among them) ever see them."""
    creds_line, env = credentials_from(env)
    argv = [sys.executable, "-m", "vllm_kvbridge.pipeline.stage_process", "--address", address]
    argv += ["--stage-id", str(stage_id), "--heartbeat-s", f"{heartbeat_s:g}"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )
    assert proc.stdin is not None
    proc.stdin.write(creds_line + stage_json)
    proc.stdin.close()
    return proc


def spawn_stage(
    stage: ResolvedStage, address: str, log_path: Path, env: Mapping[str, str], heartbeat_s: float
) -> StageHandle:
    """Start ``stage``'s process here, as a child of the orchestrator."""
    popen = start_stage_process(
        msgspec.json.encode(stage), stage.stage_id, address, log_path, stage_env(stage, env), heartbeat_s
    )
    now = time.monotonic()
    return StageHandle(stage, LocalStageProcess(popen, log_path), log_path, now, last_seen=now)


def stop_stages(
    handles: Sequence[StageHandle], shutdown: Callable[[StageHandle], None], shutdown_timeout: float
) -> None:
    """Ask every running stage to stop (``shutdown`` sends it ``Shutdown``), wait up to
    ``shutdown_timeout``, SIGTERM the process groups of those still running, and after 5 s
    more kill every group for good (:func:`kill_stage_group`: vLLM engine-core children
    included)."""
    for h in handles:
        if h.proc.poll() is None:
            shutdown(h)
    _wait_exit(handles, time.monotonic() + shutdown_timeout)
    alive = [h for h in handles if h.proc.poll() is None]
    for h in alive:
        h.proc.terminate_group()
    _wait_exit(alive, time.monotonic() + 5.0)
    for h in handles:
        # Also for a stage that exited by itself: its engine core may outlive it.
        h.proc.kill_group(h.shm_names)
    _wait_exit(handles, time.monotonic() + 5.0)


def reap_run_edges(stages: Sequence[ResolvedStage]) -> None:
    """Reap what the stopped stages' processes left on every edge of the run."""
    from vllm_kvbridge.connectors.leftovers import reap_dead_leftovers, reap_dead_runs

    reap_dead_leftovers(
        (e.from_stage, e.to_stage, e.connector.name, e.connector.config)
        for s in stages
        for e in (*s.inputs, *s.outputs)
    )
    # And, host-wide, whatever any run whose processes all died left behind (its vLLM
    # queues and semaphores too): each process of a run holds an owner lock while it lives.
    reap_dead_runs()


class RunShm:
    """A run's hold on /dev/shm (``connectors/shm_owners.py``), from its orchestrator: an owner
    lock held while the process lives (the kernel drops it however the process dies), so a
    successor reaps what this run left; dead runs' leftovers are reaped at its start, when a
    stage is lost and at its close. Its stage processes hold locks of the same run
    (``RUN_ID_ENV`` in ``env``)."""

    def __init__(self, run_id: str, env: dict[str, str]) -> None:
        from vllm_kvbridge.connectors.leftovers import RUN_ID_ENV

        self._owner = hold_shm_owner(run_id, "orchestrator")
        env[RUN_ID_ENV] = run_id
        self.reap()

    @staticmethod
    def reap() -> None:
        from vllm_kvbridge.connectors.leftovers import reap_dead_runs

        reap_dead_runs()

    def started(self) -> None:
        """Record the names this process mapped while the stages started (its semaphores)."""
        if self._owner is not None:
            self._owner.record_mapped(descendants=False)

    def close(self) -> None:
        """After the stages stopped: release this run's names, then reap the stages' records."""
        if self._owner is not None:
            self._owner.release()
        self.reap()


def hold_shm_owner(run_id: str | None, role: str) -> Any:
    """This process's owner lock for its run's shared-memory names (``connectors/shm_owners.py``),
    or None where it cannot be taken (logged: reaping then falls back to the edge leftovers)."""
    from vllm_kvbridge.connectors.leftovers import hold_owner

    try:
        return hold_owner(run_id, role)
    except (OSError, ValueError) as exc:
        logger.warning(
            "kvbridge: no shared-memory owner lock for %s (%s): its names are reaped by edge only", role, exc
        )
        return None


def _wait_exit(handles: Sequence[StageHandle], deadline: float) -> None:
    for h in handles:
        with contextlib.suppress(subprocess.TimeoutExpired):
            h.proc.wait(timeout=max(0.0, deadline - time.monotonic()))


def shm_mapped_by_group(pgid: int) -> set[str]:
    """/dev/shm names whose files the live processes of group ``pgid`` map (by inode:
    :func:`~vllm_kvbridge.connectors.shm_owners.names_mapped_by`, so vLLM's ``sem.mp-*``
    semaphores too), but our connectors' (their reapers know the owners: see
    :mod:`vllm_kvbridge.connectors.leftovers`)."""
    return set(shm_owners.names_mapped_by(group_pids(pgid), shm_owners.SHM_DIR, _not_a_connectors))


def _not_a_connectors(name: str) -> bool:
    return not name.startswith("kvbridge.")


def kill_stage_group(
    pgid: int, known: set[str] | frozenset[str] = frozenset(), wait_s: float = 5.0
) -> list[str]:
    """SIGKILL the process group of a stage (its vLLM engine-core children too), wait up to
    ``wait_s`` for it to go, and unlink the shared memory it mapped (now, or ``known``
    from earlier) that nothing maps any more: a killed vLLM engine cannot remove its own
    message queues (``psm_*``, up to hundreds of MB) or semaphores (``sem.mp-*``), and a
    supervised stage restarted a few times would fill /dev/shm. Returns the names removed."""
    mapped = shm_mapped_by_group(pgid) | set(known)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not mapped:
        return []
    in_use = shm_owners.all_mapped(shm_owners.SHM_DIR)
    removed = []
    for name in sorted(mapped):
        with contextlib.suppress(OSError):
            ino = os.lstat(os.path.join(shm_owners.SHM_DIR, name)).st_ino
            if shm_owners.unlink_if_unused(shm_owners.SHM_DIR, name, ino, in_use) == "removed":
                removed.append(name)
    return removed


def group_alive(pgid: int) -> list[int]:
    """The pids of group ``pgid`` still alive (zombies are not)."""
    alive = []
    for pid in group_pids(pgid):
        if state(pid) not in (None, "Z"):
            alive.append(pid)
    return alive


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def exit_cause(code: int, tail: str) -> str:
    """Why a stage process that exited with ``code`` did: the signal that killed it (its log's
    last line then says nothing about it: it was whatever it logged last, e.g. a warning), or
    the exception line of the last traceback in its log."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    lines = tail.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return "no error in its log"
    # The exception line: the first unindented line after the frames of the last traceback.
    after = (line.strip() for line in lines[starts[-1] + 1 :] if line.strip() and not line.startswith(" "))
    return next(after, "a traceback without its exception line")


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
        def scoped(name: str, config: dict[str, Any]) -> dict[str, Any]:
            if name not in RUN_NAMESPACED or "namespace" in config or {a, b} & external:
                return config
            return {**config, "namespace": f"{run_id}-{edge_name(a, b)}"}

        return map_leaves(c, scoped)

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


def leaves(c: ResolvedConnector) -> list[tuple[str, dict[str, Any]]]:
    """(name, config) of the connectors ``c`` is: itself, or a routed end's routes."""
    if c.name != ROUTED:
        return [(c.name, c.config)]
    return [(v["name"], dict(v.get("config") or {})) for v in c.config["routes"].values()]


def map_leaves(
    c: ResolvedConnector, fn: Callable[[str, dict[str, Any]], dict[str, Any]]
) -> ResolvedConnector:
    """``c`` with the config of each of its :func:`leaves` replaced by ``fn(name, config)``."""
    if c.name != ROUTED:
        config = fn(c.name, c.config)
        return c if config is c.config else msgspec.structs.replace(c, config=config)
    routes = {
        r: (v["name"], fn(v["name"], dict(v.get("config") or {}))) for r, v in c.config["routes"].items()
    }
    return msgspec.structs.replace(c, config=routed_config(routes))


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

    # Each end of an edge may name its own connector (output_connectors / input_connectors);
    # a replica's end may hold a ZMQ route among others (connectors/routed.py).
    ends: dict[tuple[int, int], list[tuple[str, dict[str, Any]]]] = {}
    beyond: set[tuple[int, int]] = set()
    for s in stages:
        for e in (*s.inputs, *s.outputs):
            edge = (e.from_stage, e.to_stage)
            ends.setdefault(edge, []).extend(leaves(e.connector))
            tcp = [cfg for name, cfg in leaves(e.connector) if name == ZMQ_CONNECTOR]
            if e.role == "sender" and any(binds_beyond_loopback(cfg) for cfg in tcp):
                beyond.add(edge)
    keys: dict[tuple[int, int], str] = {}
    for edge in sorted(beyond):
        if not any(k.startswith("curve_") for _, cfg in ends[edge] for k in cfg) and not set(edge) & external:
            public, secret = zmq.curve_keypair()
            keys[edge] = json.dumps({"public": public.decode(), "secret": secret.decode()})
    if not keys:
        return stages

    def fix(e: Any, env: dict[str, str]) -> Any:
        pair = keys.get((e.from_stage, e.to_stage))
        if pair is None or not any(name == ZMQ_CONNECTOR for name, _ in leaves(e.connector)):
            return e
        var = f"{CURVE_ENV_PREFIX}{e.from_stage}_{e.to_stage}"
        env[var] = pair

        def keyed(name: str, config: dict[str, Any]) -> dict[str, Any]:
            return {**config, "curve_keys_env": var} if name == ZMQ_CONNECTOR else config

        return msgspec.structs.replace(e, connector=map_leaves(e.connector, keyed))

    out = []
    for s in stages:
        env = dict(s.env)
        inputs = [fix(e, env) for e in s.inputs]
        outputs = [fix(e, env) for e in s.outputs]
        out.append(msgspec.structs.replace(s, inputs=inputs, outputs=outputs, env=env))
    return out
