"""``vllm-kvbridge bench soak --faults``: what the server was hardened against, under load.

Each fault of issue 36 is injected in turn while the soak's load runs (the load goes on
until the last one is over), after the soak's ``--kill``s are over and ``--fault-gap``
seconds apart, each on a healthy server, and each reports whether the
server held (what it should do, checked from the outside) and how long it took to be
healthy again:

* ``forged``: frames a local intruder sends to the orchestrator's control address (one
  byte, two frames where one is expected, a forged ``StageFailed`` naming a live stage's
  pid). Held: the control plane counted them refused (``kvbridge_control_rejected``) and
  every stage kept its process.
* ``sigstop``: every engine process of a stage (the descendants of its process: vLLM's
  engine core and workers) stopped while the stage process keeps beating. Held: the stage
  was found hung (``recovering``) and is back with a new process; the stopped processes are
  gone.
* ``big-body``: one request body of ``--big-body-mb`` MB, with ``/health`` timed meanwhile.
  Held: answered 413 (the slowest ``/health`` answer is reported).
* ``full-shm``: ``/dev/shm`` filled by a ballast file for ``--full-shm-s`` seconds, then
  freed. Held: ``/health`` kept answering and the server is healthy afterwards (the
  requests the full edge failed are in the load's counts). Refused (not run) when filling
  would take more than half the host's available memory: ``/dev/shm`` is memory; run the
  server where it is small (a container's, or ``unshare --mount`` with a small tmpfs).
* ``restart``: the server SIGKILLed and a successor started on its port (only for a server
  the soak started). Held: the successor is healthy and nothing of the killed run is left
  in ``/dev/shm`` (its segments, owner files; the final leftovers count vLLM's queues).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from vllm_kvbridge import procfs

__all__ = ["FAULTS", "FaultOutcome", "FaultRunner", "parse_faults", "wait_healthy"]

FAULTS = ("forged", "sigstop", "big-body", "full-shm", "restart")
BALLAST_PREFIX = "kvbridge-soak-ballast."


@dataclass
class FaultOutcome:
    fault: str
    #: seconds into the load when it was injected
    at_s: float = 0.0
    #: whether the server did what it should; None: not run (``detail`` says why)
    held: bool | None = None
    detail: str = ""
    #: seconds from the fault until the server was healthy again (faults that take a part down)
    recovery_s: float | None = None


def parse_faults(text: str) -> list[str]:
    names = list(FAULTS) if text == "all" else [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in names if f not in FAULTS]
    if unknown or not names:
        raise SystemExit(f"vllm-kvbridge bench soak: --faults takes 'all' or some of {', '.join(FAULTS)}")
    return names


def wait_healthy(
    client: httpx.Client, timeout_s: float, not_pid: tuple[int, int] | None = None
) -> float | None:
    """Seconds until ``/health`` is ok (with stage ``not_pid[0]`` on a pid other than
    ``not_pid[1]``: it was restarted), or None if it never was within ``timeout_s`` or the
    pipeline is down for good. A server that does not answer (restarting) is waited for."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(httpx.HTTPError):
            h = client.get("/health", timeout=10).json()
            if h["status"] == "down":
                return None
            pids = {s["stage_id"]: s.get("pid") for s in h["stages"]}
            if h["status"] == "ok" and (not_pid is None or pids.get(not_pid[0]) != not_pid[1]):
                return time.monotonic() - t0
        time.sleep(0.1)
    return None


class FaultRunner:
    """Injects ``faults`` one after another from a thread of its own (:meth:`start`)."""

    def __init__(
        self,
        client: httpx.Client,
        faults: list[str],
        path: str,
        *,
        restart: Callable[[], int] | None,
        gap_s: float,
        recovery_timeout_s: float,
        big_body_mb: float = 20.0,
        full_shm_s: float = 5.0,
    ) -> None:
        self.client, self.faults, self.path = client, faults, path
        self.outcomes = [FaultOutcome(f) for f in faults]
        #: SIGKILLs the server and starts its successor on the same address (its pid);
        #: None: a server the soak did not start, which it cannot restart
        self._restart_server = restart
        self.gap_s, self.recovery_timeout_s = gap_s, recovery_timeout_s
        self.big_body_mb, self.full_shm_s = big_body_mb, full_shm_s
        #: run ids of servers the ``restart`` fault killed (their leftovers are counted)
        self.killed_runs: list[str] = []
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self, load_start: float, after: list[threading.Thread]) -> None:
        """Start injecting once ``after`` (the soak's stage kills) are over: one fault at a
        time, each on a healthy server, so that each outcome is the fault's own."""
        self._load_start, self._after = load_start, after
        self._thread.start()

    def join(self) -> None:
        self._thread.join()

    # -- the thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for t in self._after:
                t.join()
            self._healthy(self.recovery_timeout_s)
            for outcome in self.outcomes:
                time.sleep(self.gap_s)
                outcome.at_s = time.monotonic() - self._load_start
                try:
                    getattr(self, "_" + outcome.fault.replace("-", "_"))(outcome)
                except Exception as exc:  # a fault that could not be injected is reported
                    outcome.held, outcome.detail = False, f"{type(exc).__name__}: {exc}"
                self._healthy(self.recovery_timeout_s)  # the next fault starts on a healthy server
        finally:
            self.done.set()

    def _get(self, url: str, timeout: float = 10.0) -> httpx.Response | None:
        with contextlib.suppress(httpx.HTTPError):
            return self.client.get(url, timeout=timeout)
        return None

    def _health(self) -> dict[str, Any] | None:
        r = self._get("/health")
        return r.json() if r is not None else None

    def _healthy(self, timeout_s: float, not_pid: tuple[int, int] | None = None) -> float | None:
        return wait_healthy(self.client, timeout_s, not_pid)

    def _stage_pids(self) -> dict[int, int]:
        h = self._health() or {"stages": []}
        return {s["stage_id"]: s["pid"] for s in h["stages"] if "pid" in s}

    def _rejected(self) -> float:
        r = self._get("/metrics")
        lines = r.text.splitlines() if r is not None else []
        return sum(
            float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("kvbridge_control_rejected_total")
        )

    # -- the faults ---------------------------------------------------------------------
    def _forged(self, out: FaultOutcome) -> None:
        import zmq

        from vllm_kvbridge.pipeline import messages as m

        address = self.client.get("/debug/state").json()["control_address"]
        pids, first = self._stage_pids(), self._rejected()
        before = first
        sid, pid = next(iter(pids.items()))
        frames = [
            [b"x"],
            [b"stage-0", m.encode(m.Heartbeat(sid, pid))],
            [m.encode(m.StageFailed(sid, "forged", pid=pid))],
        ]
        ctx = zmq.Context()
        try:
            for parts in frames:  # one connection each, as separate intruders
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                sock.send_multipart(parts)
                deadline = time.monotonic() + 10
                while self._rejected() <= before and time.monotonic() < deadline:
                    time.sleep(0.1)
                sock.close(0)
                before = self._rejected()
        finally:
            ctx.term()
        refused = self._rejected() - first
        kept = self._stage_pids() == pids
        out.held = kept and refused >= len(frames)
        out.detail = f"{len(frames)} intruders, {refused:g} refused; stages kept their processes: {kept}"

    def _sigstop(self, out: FaultOutcome) -> None:
        pids = self._stage_pids()
        engines = {sid: procfs.descendants(pid) for sid, pid in pids.items()}
        sid = next((s for s, kids in engines.items() if kids), None)
        if sid is None:
            out.detail = "no stage has engine processes of its own (nothing to stop)"
            return
        stopped = engines[sid]
        for p in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            back = self._healthy(self.recovery_timeout_s, not_pid=(sid, pids[sid]))
        finally:
            for p in stopped:  # never leave a process stopped (killed by now if it was found)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGCONT)
        out.recovery_s = None if back is None else time.monotonic() - t0
        out.held = back is not None
        found = "found hung and restarted" if back is not None else "never found"
        out.detail = f"stage {sid}: {len(stopped)} engine process(es) stopped; {found}"

    def _big_body(self, out: FaultOutcome) -> None:
        size = int(self.big_body_mb * 1e6)
        body = b'{"prompt": "' + b"a" * size + b'"}'
        answer: list[int] = []

        def post() -> None:
            try:
                r = self.client.post(self.path, content=body, headers={"content-type": "application/json"})
                answer.append(r.status_code)
            except httpx.HTTPError as exc:
                answer.append(-1)
                out.detail = f"{type(exc).__name__}: {exc}; "

        t = threading.Thread(target=post)
        t.start()
        slowest = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            self._get("/health", timeout=30)
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.05)
        t.join()
        out.held = answer == [413]
        out.detail += (
            f"{size / 1e6:.0f} MB body answered {answer[0]}; slowest /health meanwhile {slowest:.3f} s"
        )

    def _full_shm(self, out: FaultOutcome) -> None:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
        available = _mem_available()
        if free > available // 2:
            out.detail = (
                f"not run: filling /dev/shm takes {free / 2**30:.1f} GiB of memory"
                f" ({available / 2**30:.1f} GiB available); run the server with a smaller /dev/shm"
            )
            return
        path = f"/dev/shm/{BALLAST_PREFIX}{os.getpid()}"
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        answered, t0 = 0, time.monotonic()
        try:
            with contextlib.suppress(OSError):  # as much as fits: that is the point
                os.posix_fallocate(fd, 0, free)
            left = os.statvfs("/dev/shm").f_bavail * st.f_frsize
            while time.monotonic() - t0 < self.full_shm_s:
                answered += self._get("/health") is not None
                time.sleep(0.5)
        finally:
            os.close(fd)
            os.unlink(path)
        back = self._healthy(self.recovery_timeout_s)
        out.recovery_s = back
        out.held = back is not None and answered > 0
        out.detail = (
            f"/dev/shm full ({left} bytes left) for {self.full_shm_s:g} s; /health answered"
            f" {answered} time(s) meanwhile; healthy after: {back is not None}"
        )

    def _restart(self, out: FaultOutcome) -> None:
        if self._restart_server is None:
            out.detail = "not run: the soak did not start this server (--stage-config)"
            return
        from vllm_kvbridge.connectors.leftovers import shared_memory_names
        from vllm_kvbridge.connectors.shm_owners import owners

        run = self.client.get("/debug/state").json()["run_id"]
        t0 = time.monotonic()
        self._restart_server()
        self.killed_runs.append(run)
        back = self._healthy(self.recovery_timeout_s)
        out.recovery_s = None if back is None else time.monotonic() - t0
        # The successor reaped the killed run at its start; a name still mapped by a dying
        # process of it goes at the next reap, so give it the time a stage takes to notice.
        deadline = time.monotonic() + 10
        while (left := [*shared_memory_names(run), *owners(prefix=run)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        out.held = back is not None and not left
        out.detail = f"run {run} killed; successor healthy: {back is not None}; its names left: {len(left)}"


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
