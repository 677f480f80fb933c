"""``vllm-kvbridge bench soak``: load, client aborts and stage kills against a real server.

Drives ``vllm-kvbridge serve`` (started here from ``--stage-config``, or a running one at
``--url`` on this host) with ``--requests`` requests from ``--concurrency`` client threads.
A fraction ``--abort-frac`` of them hang up mid-request (a client timeout drawn below the
unloaded latency); a 429 or 503 with ``Retry-After`` is waited out and tried again, as
OpenAI's clients do (counted as ``retried``); ``--kill STAGE@SECONDS`` SIGKILLs a stage's
process that many seconds into the load (the pid comes from ``/health``, so the server
must run on this host) and measures how long the supervisor takes to have it ready again.
``--faults`` injects the faults the server was hardened against (forged control frames,
a stopped engine, a huge body, a full /dev/shm, a server SIGKILL and restart; see
:mod:`vllm_kvbridge.bench.soak_faults`) one after another while the load runs, which then
goes on until the last one is over.

Printed as a table (and ``--json FILE``): requests ok / failed (by HTTP status) / lost (no
answer at all: the connection dropped) / aborted,
latency p50 / p99 of the successful ones and each as a ratio to the unloaded latency
measured first in the same run (``--baseline`` sequential requests, median and spread),
throughput and its ratio to the sequential rate ``1 / unloaded latency`` (what
``--concurrency 1`` reaches, measured in the same run), recovery
seconds per kill, and leftovers: KV payloads published but not consumed once the load
drained, the server's thread count before and after the load, and (for a server started
here) what is left in /dev/shm after it stopped: the segments and owner files of its runs
(a killed one's too), vLLM's message queues, engine progress boards; and each fault's outcome.
Nothing is asserted: a soak reports what it saw.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vllm_kvbridge.bench.soak_faults import FAULTS, FaultOutcome, FaultRunner, parse_faults, wait_healthy
from vllm_kvbridge.models.model_args import add_model_arguments, chosen_model

#: Tries again of one request answered 429 / 503 with Retry-After, at most.
MAX_RETRIES = 20

__all__ = ["SoakResult", "add_arguments", "format_result", "run", "write_json"]


@dataclass
class Kill:
    stage_id: int
    at_s: float
    pid: int = 0
    killed_at_s: float = 0.0
    #: seconds from the kill until /health was ok with a new pid for the stage (None: never)
    recovery_s: float | None = None


@dataclass
class SoakResult:
    requests: int
    concurrency: int
    ok: int = 0
    aborted: int = 0
    #: answers 429 / 503 with Retry-After that the client waited out and tried again
    retried: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # HTTP status (or error type) -> count
    #: requests that got no answer at all (the connection dropped: a server killed under them)
    lost: int = 0
    baseline_s: float = 0.0
    #: every unloaded latency measured (``baseline_s`` is their median): the spread
    baseline_all_s: list[float] = field(default_factory=list)
    p50_s: float = 0.0
    p99_s: float = 0.0
    wall_s: float = 0.0
    kills: list[Kill] = field(default_factory=list)
    faults: list[FaultOutcome] = field(default_factory=list)
    leftovers: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.ok / self.wall_s if self.wall_s else 0.0

    @property
    def throughput_ratio(self) -> float | None:
        """Throughput under load over the sequential rate ``1 / baseline_s`` of the same run
        (what concurrency 1 reaches): how much the server gains from concurrent requests."""
        return self.throughput * self.baseline_s if self.baseline_s else None


def add_arguments(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--stage-config", help="start `vllm-kvbridge serve` with this config")
    where.add_argument(
        "--url", help="drive a server already running on this host (started with --debug-endpoints)"
    )
    add_model_arguments(p, "model for the started server (default: the tiny offline model)")
    p.add_argument("--requests", type=int, default=1000, help="requests in all (default 1000)")
    p.add_argument("--concurrency", type=int, default=8, help="client threads (default 8)")
    p.add_argument(
        "--abort-frac", type=float, default=0.1, help="share of requests the client abandons (0.1)"
    )
    p.add_argument(
        "--kill", action="append", default=[], metavar="STAGE@SECONDS", help="SIGKILL a stage (repeatable)"
    )
    p.add_argument("--baseline", type=int, default=5, help="unloaded requests timed first (default 5)")
    p.add_argument("--recovery-timeout", type=float, default=600.0, help="seconds to wait for a killed stage")
    p.add_argument("--api-key", default=os.environ.get("VLLM_KVBRIDGE_API_KEY"))
    p.add_argument("--seed", type=int, default=0, help="which requests abort, and when")
    p.add_argument(
        "--faults",
        type=parse_faults,
        default=[],
        metavar="LIST",
        help=f"inject these faults under the load, in order: 'all' or some of {','.join(FAULTS)}",
    )
    p.add_argument("--fault-gap", type=float, default=3.0, help="seconds before each fault (default 3)")
    p.add_argument("--big-body-mb", type=float, default=20.0, help="the big-body fault's size (default 20)")
    p.add_argument("--full-shm-s", type=float, default=5.0, help="how long full-shm holds (default 5)")
    p.add_argument("--json", metavar="OUT", help="also write the result as JSON to OUT")


def parse_kill(text: str) -> Kill:
    stage, sep, at = text.partition("@")
    try:
        if not sep:
            raise ValueError
        return Kill(int(stage), float(at))
    except ValueError:
        raise SystemExit(f"vllm-kvbridge bench soak: --kill wants STAGE@SECONDS, got {text!r}") from None


class _Server:
    """``vllm-kvbridge serve`` in its own session on a free loopback port."""

    def __init__(self, config: str, model: str | None, log: Path, port: int = 0) -> None:
        if not port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.config, self.model, self.port = config, model, port
        # --debug-endpoints: the soak reads /debug/state and the stages' pids, and sends no key.
        argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "serve", "--stage-config", config]
        argv += ["--debug-endpoints"]
        argv += ["--port", str(port), "--drain-timeout", "5"] + (["--model", model] if model else [])
        self.url, self.log = f"http://127.0.0.1:{port}", log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"the server was not healthy after {timeout_s:.0f} s; see {self.log}")

    def crash(self) -> _Server:
        """SIGKILL the server (only it: its stages notice and go) and start its successor
        on the same port, once the port is free."""
        self.proc.kill()
        self.proc.wait()
        successor = _Server(self.config, self.model, self.log, self.port)
        successor.wait_ready()
        return successor

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def _threads(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _psm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")} if os.path.isdir("/dev/shm") else set()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run(args: argparse.Namespace) -> SoakResult:
    kills = [parse_kill(k) for k in args.kill]
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.abort_frac <= 1:
        raise SystemExit(
            "vllm-kvbridge bench soak: need --requests >= 1, --concurrency >= 1, 0 <= --abort-frac <= 1"
        )
    servers: list[_Server] = []  # the one serving last (a restart fault adds its successor)
    psm_before = _psm()
    if args.stage_config:
        log = Path(tempfile.mkdtemp(prefix="kvbridge-soak-")) / "serve.log"
        # --arch: the tiny model is built here once, and the server is given its directory.
        servers.append(_Server(args.stage_config, chosen_model(args), log))
        print(f"starting the server (log {log})", flush=True)
        servers[0].wait_ready()
        url = servers[0].url
    else:
        url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(base_url=url, headers=headers, timeout=600)
    try:
        return _soak(client, args, kills, servers, psm_before)
    finally:
        client.close()
        if servers:
            servers[-1].stop()


def _soak(
    client: httpx.Client,
    args: argparse.Namespace,
    kills: list[Kill],
    servers: list[_Server],
    psm_before: set[str],
) -> SoakResult:
    models = client.get("/v1/models").json()["data"][0]
    image = models["kvbridge"]["output"] == "image"
    path = "/v1/images/generations" if image else "/v1/completions"

    def body(i: int) -> dict[str, Any]:
        return {"prompt": f"soak request {i}"} if image else {"prompt": f"soak request {i}", "max_tokens": 8}

    baseline = []
    for i in range(max(1, args.baseline)):
        t0 = time.monotonic()
        r = client.post(path, json=body(-1 - i))
        if r.status_code != 200:
            raise SystemExit(
                f"vllm-kvbridge bench soak: an unloaded request failed: {r.status_code} {r.text}"
            )
        baseline.append(time.monotonic() - t0)
    res = SoakResult(
        args.requests, args.concurrency, baseline_s=statistics.median(baseline), baseline_all_s=baseline
    )
    state = client.get("/debug/state").json()
    threads_before = _threads(servers[-1].proc.pid if servers else None)
    faults = None
    if args.faults:

        def restart() -> int:
            servers.append(servers[-1].crash())
            return servers[-1].proc.pid

        faults = FaultRunner(
            client,
            args.faults,
            path,
            restart=restart if servers else None,
            gap_s=args.fault_gap,
            recovery_timeout_s=args.recovery_timeout,
            big_body_mb=args.big_body_mb,
            full_shm_s=args.full_shm_s,
        )
    rng = random.Random(args.seed)
    lock = threading.Lock()
    latencies: list[float] = []
    issued = 0

    def next_request() -> tuple[int, bool, float] | None:
        """The next request's index, whether the client abandons it and when; None when the
        load is over (``--requests`` sent, and the faults, if any, are over)."""
        nonlocal issued
        with lock:
            if issued >= args.requests and (faults is None or faults.done.is_set()):
                return None
            issued += 1
            return issued - 1, rng.random() < args.abort_frac, rng.uniform(0.05, max(0.1, res.baseline_s))

    def one(i: int, abort: bool, cutoff: float, http: httpx.Client) -> None:
        t0 = time.monotonic()
        retries, lost = 0, False
        try:
            timeout = httpx.Timeout(cutoff) if abort else httpx.Timeout(600)
            while True:
                try:
                    r = http.post(path, json=body(i), timeout=timeout)
                except httpx.ConnectError:
                    # Never reached a server (one restarting): safe to try again, as clients do.
                    if retries >= MAX_RETRIES * 10:
                        raise
                    retries += 1
                    time.sleep(1.0)
                    continue
                # As OpenAI's clients do: a 429 / 503 with Retry-After is tried again later.
                if r.status_code in (429, 503) and "retry-after" in r.headers and retries < MAX_RETRIES:
                    retries += 1
                    time.sleep(float(r.headers["retry-after"]))
                    continue
                break
            key = None if r.status_code == 200 else str(r.status_code)
        except httpx.TimeoutException:
            key = "aborted" if abort else "client_timeout"
        except httpx.TransportError:
            key, lost = None, True  # the connection dropped: no answer at all
        except httpx.HTTPError as exc:
            key = type(exc).__name__
        with lock:
            res.retried += retries
            if lost:
                res.lost += 1
            elif key is None:
                res.ok += 1
                latencies.append(time.monotonic() - t0)
            elif key == "aborted":
                res.aborted += 1
            else:
                res.failed[key] = res.failed.get(key, 0) + 1

    def worker() -> None:
        with httpx.Client(base_url=str(client.base_url), headers=client.headers) as http:
            while (nxt := next_request()) is not None:
                one(*nxt, http)

    start = time.monotonic()
    killers = [
        threading.Thread(target=_kill_and_watch, args=(client, k, start, args.recovery_timeout))
        for k in kills
    ]
    for t in killers:
        t.start()
    if faults is not None:
        faults.start(start, after=killers)
    with ThreadPoolExecutor(args.concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(args.concurrency)]:
            f.result()
    res.wall_s = time.monotonic() - start
    for t in killers:
        t.join()
    if faults is not None:
        faults.join()
        res.faults = faults.outcomes
    res.requests = issued
    res.kills = kills
    res.p50_s, res.p99_s = _percentile(latencies, 0.5), _percentile(latencies, 0.99)
    # Leftovers once the load drained: nothing in flight, nothing published and unread.
    deadline = time.monotonic() + 60
    after = client.get("/debug/state").json()
    while (after["in_flight"] or after["shm_published"]) and time.monotonic() < deadline:
        time.sleep(0.5)
        after = client.get("/debug/state").json()
    res.leftovers = {
        "in_flight": after["in_flight"],
        "published_unread": len(after["shm_published"]),
        "server_threads_before": threads_before if len(servers) < 2 else None,
        "server_threads_after": _threads(servers[-1].proc.pid) if len(servers) == 1 else None,
    }
    if servers:
        res.leftovers["server_exit"] = servers[-1].stop()
        runs = [state["run_id"], *(faults.killed_runs if faults else []), after["run_id"]]
        res.leftovers.update(_shm_left(sorted(set(runs)), psm_before))
    return res


def _shm_left(runs: list[str], psm_before: set[str]) -> dict[str, int]:
    """What a server's runs left in /dev/shm once it stopped: each should be 0."""
    from vllm_kvbridge.bench.soak_faults import BALLAST_PREFIX
    from vllm_kvbridge.connectors.leftovers import shared_memory_names
    from vllm_kvbridge.connectors.shm_owners import owners
    from vllm_kvbridge.runner.progress import PREFIX as PROGRESS_PREFIX

    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {
        "shm_after_stop": sum(len(shared_memory_names(run)) for run in runs),
        "owner_files_after_stop": sum(len(owners(prefix=run)) for run in runs),
        "vllm_queues_after_stop": len(_psm() - psm_before),
        "progress_boards_after_stop": sum(n.startswith(PROGRESS_PREFIX) for n in names),
        "ballast_after_stop": sum(n.startswith(BALLAST_PREFIX) for n in names),
    }


def _kill_and_watch(client: httpx.Client, kill: Kill, start: float, timeout_s: float) -> None:
    time.sleep(max(0.0, start + kill.at_s - time.monotonic()))
    stages = client.get("/health").json()["stages"]
    kill.pid = next(s["pid"] for s in stages if s["stage_id"] == kill.stage_id)
    os.kill(kill.pid, signal.SIGKILL)
    kill.killed_at_s = time.monotonic() - start
    # None: not back in time, or no restart left (down for good)
    kill.recovery_s = wait_healthy(client, timeout_s, not_pid=(kill.stage_id, kill.pid))


def format_result(r: SoakResult) -> str:
    ratio = lambda x: f"{x / r.baseline_s:.2f}x" if r.baseline_s else "-"  # noqa: E731
    failed = ", ".join(f"{k}: {v}" for k, v in sorted(r.failed.items())) or "0"
    spread = gain = ""
    if len(r.baseline_all_s) > 1:
        lo, hi = min(r.baseline_all_s), max(r.baseline_all_s)
        spread = f" (median of {len(r.baseline_all_s)}: {lo:.3f} .. {hi:.3f} s)"
    if r.throughput_ratio is not None:
        gain = f" ({r.throughput_ratio:.2f}x the sequential {1 / r.baseline_s:.2f}/s)"
    rows = [
        ("requests (concurrency)", f"{r.requests} ({r.concurrency})"),
        ("ok", str(r.ok)),
        ("failed (by status)", failed),
        ("lost (no answer)", str(r.lost)),
        ("aborted by the client", str(r.aborted)),
        ("retried after 429/503", str(r.retried)),
        ("unloaded latency (ceiling)", f"{r.baseline_s:.3f} s{spread}"),
        ("p50 latency", f"{r.p50_s:.3f} s ({ratio(r.p50_s)} unloaded)"),
        ("p99 latency", f"{r.p99_s:.3f} s ({ratio(r.p99_s)} unloaded)"),
        ("throughput", f"{r.throughput:.2f} ok/s over {r.wall_s:.1f} s{gain}"),
    ]
    for k in r.kills:
        back = "not back" if k.recovery_s is None else f"back in {k.recovery_s:.1f} s"
        rows.append((f"kill stage {k.stage_id} at {k.killed_at_s:.1f} s", back))
    for f in r.faults:
        verdict = {True: "held", False: "NOT HELD", None: "not run"}[f.held]
        back = "" if f.recovery_s is None else f", healthy again in {f.recovery_s:.1f} s"
        rows.append((f"fault {f.fault} at {f.at_s:.1f} s", f"{verdict}{back}: {f.detail}"))
    rows += [(f"leftover: {k}", str(v)) for k, v in r.leftovers.items()]
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def write_json(r: SoakResult, path: str) -> None:
    data = asdict(r)
    data["throughput"] = r.throughput
    data["throughput_ratio"] = r.throughput_ratio
    data["p50_ratio"] = r.p50_s / r.baseline_s if r.baseline_s else None
    data["p99_ratio"] = r.p99_s / r.baseline_s if r.baseline_s else None
    Path(path).write_text(json.dumps(data, indent=2))
