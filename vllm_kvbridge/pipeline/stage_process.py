"""The main program of one stage process.

Started by the orchestrator as ``python -m vllm_kvbridge.pipeline.stage_process --address
ADDR --stage-id N --heartbeat-s S`` with, on stdin, one line of control-plane credentials
(:class:`~vllm_kvbridge.pipeline.control_auth.StageCredentials`: this process's CURVE
keypair, the orchestrator's key, its routing id) and then the stage's
:class:`ResolvedStage` as JSON (no pickle crosses the process boundary). It builds the
stage's engine (a vLLM engine with the kvbridge worker for LLM stages, the diffusion
runner for diffusion stages), reports :class:`Ready`, then serves :class:`Submit` messages
until :class:`Shutdown`. From its start a thread sends :class:`Heartbeat` every ``S``
seconds on a socket of its own (ZMQ sockets are not thread-safe), so the orchestrator can
tell a stopped or starved process from one busy in a long step (see
:mod:`vllm_kvbridge.pipeline.supervision`).

Failure contract: an exception while starting or an unexpected one while serving is sent
as :class:`StageFailed` (with the traceback) and the process exits with status 1; an
error that concerns one request only (a transfer of its, or its input refused by the
engine: :class:`~vllm_kvbridge.errors.RequestRejected`) is sent as :class:`RequestFailed`
and the stage keeps serving. The process runs in its own session (the orchestrator kills the whole
group, engine-core children included, as a last resort) and kills its group itself when
the orchestrator disappears, so a stage never outlives its pipeline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator

import msgspec
import zmq

from vllm_kvbridge.config.resolve import ResolvedStage
from vllm_kvbridge.connectors.leftovers import RUN_ID_ENV, ShmOwner
from vllm_kvbridge.errors import RequestRejected
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.control_auth import StageCredentials, read_credentials
from vllm_kvbridge.pipeline.engines import StageEngine, build_engine
from vllm_kvbridge.pipeline.liveness import EngineLiveness
from vllm_kvbridge.pipeline.stage_handles import hold_shm_owner
from vllm_kvbridge.runner import progress

#: How long the serve loop sleeps in poll when the engine has nothing to do (seconds); an
#: engine's waker (``StageEngine.waker``) or a message ends the sleep at once.
IDLE_POLL_S = 0.02
#: How often a stage looks at its connectors' counters (and reports them when they changed).
STATS_S = 2.0


class _Terminated(BaseException):
    """Raised in the main thread by SIGTERM so ``finally`` blocks release resources."""


def _watch_parent(parent_pid: int) -> None:
    """Kill this process group when the orchestrator is gone (it can no longer clean up)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            try:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            finally:
                os._exit(1)


def _connect(sock: zmq.Socket, address: str, creds: StageCredentials) -> None:
    """Connect to the orchestrator with this process's CURVE keys, pinning its key (its
    control plane admits no one else: :mod:`vllm_kvbridge.pipeline.control_auth`)."""
    creds.secure(sock)
    sock.connect(address)


class _Heartbeat:
    """Sends :class:`Heartbeat` every ``interval_s`` from a daemon thread until stopped, with
    what ``liveness`` says of the engine's progress."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        creds: StageCredentials,
        interval_s: float,
        liveness: EngineLiveness,
    ) -> None:
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 4)  # beats nobody reads are worthless: keep few
        # No routing id of its own: the orchestrator never writes to this socket.
        _connect(self._sock, address, creds)
        self._stage_id, self._liveness = creds.stage_id, liveness
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name="kvbridge-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                stalled_s, why = self._liveness.stall()
                beat = m.Heartbeat(self._stage_id, os.getpid(), round(stalled_s, 3), why)
                try:
                    self._sock.send(m.encode(beat), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the orchestrator is behind; it reads every beat queued so far
                if self._stop.wait(self._interval_s):
                    return
        finally:
            self._sock.close(0)

    def stop(self) -> None:
        """Stop beating and close the socket (before the context is terminated)."""
        self._stop.set()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def _named_board(path: str, owner: ShmOwner | None) -> Iterator[None]:
    """Name the engine's progress board (:mod:`vllm_kvbridge.runner.progress`) in the
    environment while the engine starts (its processes open it then), and remove the name
    once it is up; the stage's shared-memory owner records it meanwhile, for a stage killed
    before then."""
    os.environ[progress.PROGRESS_ENV] = path
    try:
        if owner is not None:
            owner.record([os.path.basename(path)])
        yield
    finally:
        os.environ.pop(progress.PROGRESS_ENV, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def serve(
    stage: ResolvedStage,
    address: str,
    creds: StageCredentials,
    heartbeat_s: float = 1.0,
    owner: ShmOwner | None = None,
) -> int:
    """Run ``stage`` until :class:`Shutdown` (exit status). ``owner``: this process's lock on
    its run's shared-memory names; the names its engine maps are recorded in it."""
    ctx = zmq.Context()
    path, board = progress.create()
    liveness = EngineLiveness(board)
    heartbeat = _Heartbeat(ctx, address, creds, heartbeat_s, liveness)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.IDENTITY, creds.route.encode())
    _connect(sock, address, creds)
    engine: StageEngine | None = None
    try:
        try:
            with _named_board(path, owner):
                engine = build_engine(stage)
        except BaseException as exc:
            if isinstance(exc, _Terminated):
                raise
            sock.send(
                m.encode(
                    m.StageFailed(
                        stage.stage_id,
                        f"failed to start: {type(exc).__name__}: {exc}",
                        traceback.format_exc(),
                        os.getpid(),
                    )
                )
            )
            return 1
        if owner is not None:
            owner.record_mapped()  # vLLM made its queues and semaphores at start
        # its host's name: /health shows where each stage (replica) runs, on any backend
        info = {**engine.info(), "host": socket.gethostname()}
        sock.send(m.encode(m.Ready(stage.stage_id, os.getpid(), info)))
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        waker = engine.waker()
        if waker is not None:
            poller.register(waker.fileno(), zmq.POLLIN)
        counters: dict[str, float] = {}
        next_stats = time.monotonic() + STATS_S
        while True:
            liveness.turn()
            if time.monotonic() >= next_stats:  # between steps: the engine's own thread
                next_stats = time.monotonic() + STATS_S
                if owner is not None:
                    owner.record_mapped()
                now = engine.edge_counters()
                if now != counters:
                    counters = now
                    sock.send(m.encode(m.StageStats(stage.stage_id, os.getpid(), counters)))
            busy = engine.busy()
            events = dict(poller.poll(0 if busy else int(IDLE_POLL_S * 1000)))
            if waker is not None and waker.fileno() in events:
                waker.clear()  # background work completed: busy() says so now
            if sock in events:
                msg = m.decode_to_stage(sock.recv())
                if isinstance(msg, m.Shutdown):
                    return 0
                if isinstance(msg, m.Abort):
                    engine.abort(msg.request_ids)
                elif isinstance(msg, m.ProducerLost):
                    given_up = engine.producer_lost(msg)
                    for failed in given_up:
                        sock.send(m.encode(failed))
                    print(
                        f"kvbridge: producer stage {msg.stage_id} ({msg.kind}) lost: gave up"
                        f" {len(given_up)} of the {len(msg.request_ids)} request(s) it handed here",
                        file=sys.stderr,
                        flush=True,
                    )
                else:
                    try:
                        engine.submit(msg)
                    except RequestRejected as exc:
                        failed = m.RequestFailed(msg.request_id, stage.stage_id, f"invalid request: {exc}")
                        sock.send(m.encode(failed))
                continue
            for out in engine.step():
                sock.send(m.encode(out))
    except _Terminated:
        return 0
    except BaseException as exc:
        try:
            sock.send(
                m.encode(
                    m.StageFailed(
                        stage.stage_id, f"{type(exc).__name__}: {exc}", traceback.format_exc(), os.getpid()
                    )
                )
            )
        except zmq.ZMQError:
            pass
        return 1
    finally:
        if engine is not None:
            try:
                engine.close()
            except BaseException:
                traceback.print_exc()
        heartbeat.stop()
        sock.close()
        ctx.term()
        if owner is not None:
            owner.release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vllm-kvbridge stage process (started by the orchestrator)")
    parser.add_argument("--address", required=True)
    parser.add_argument("--stage-id", type=int, required=True)
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="seconds between heartbeats")
    args = parser.parse_args(argv)
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), name="kvbridge-parent-watch", daemon=True).start()

    def on_term(signum: int, frame: object) -> None:
        raise _Terminated()

    # The stage runs in its own session, so a terminal's Ctrl-C reaches only the
    # orchestrator, which tells the stages to stop (Shutdown, then SIGTERM).
    signal.signal(signal.SIGTERM, on_term)
    creds = read_credentials(sys.stdin.buffer)
    stage = msgspec.json.decode(sys.stdin.buffer.read(), type=ResolvedStage)
    if not stage.stage_id == creds.stage_id == args.stage_id:
        why = f"--stage-id {args.stage_id}, config {stage.stage_id}, credentials {creds.stage_id}"
        print(f"stage id mismatch: {why}", file=sys.stderr)
        return 2
    role = f"stage-{stage.stage_id}" + (f"-replica-{stage.replica}" if stage.replicas > 1 else "")
    owner = hold_shm_owner(None, role) if os.environ.get(RUN_ID_ENV) else None
    return serve(stage, args.address, creds, args.heartbeat_s, owner)


if __name__ == "__main__":
    sys.exit(main())
