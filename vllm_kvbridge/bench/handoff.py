"""``vllm-kvbridge bench handoff``: latency from a put on the sender to a usable object on the receiver.

For each connector and size, a sender (this process) and a receiver (a spawned process, as
stages are) hand over a stage payload as a stage does: the envelope a payload sender puts
(:func:`~vllm_kvbridge.runner.payload_stream.make_envelope`) around
``{"hidden_states": float32 [rows, 128], "token_ids": [...]}``, the tensor of the size
asked. The receiver starts waiting first; the sender sleeps a random ``--idle-ms`` (0.5x to
1.5x: a consumer has waited a while for its producer, and the phase of any polling is
spread), then puts. Latency: from the start of the put to the receiver holding the decoded
object, both read on ``time.perf_counter`` (``CLOCK_MONOTONIC``, one clock for every
process of a host), sent back over a pipe outside the timed span. Two receive paths:

* ``get``: the receiver blocks in ``Connector.get(..., deadline=...)`` (how the KV
  receiver waits), the sender calls ``Connector.put``;
* ``stage``: what a pipeline stage runs, a
  :class:`~vllm_kvbridge.runner.payload_stream.PayloadSender` (puts on its I/O thread) and a
  :class:`~vllm_kvbridge.runner.payload_receiver.PayloadReceiver` (``expect`` then
  ``result``, as a talker's stage waits for its thinker's payload), told the sender's
  doorbell as a pipeline tells it.

``bytes`` counts the rows (the envelope adds about 200 bytes of header and token ids).

The ceiling, measured in the same run with the same bytes and the same idle gaps: the bare
transport's one-way trip to a receiver blocked on it (woken by the arrival). ZMQ: a pyzmq
PAIR send of one frame over TCP loopback; shared memory: one write into an already-mapped
segment, a pipe message, one read out of it
(:func:`~vllm_kvbridge.bench.connectors.zmq_ceiling_times`,
:func:`~vllm_kvbridge.bench.connectors.shm_ceiling_times`). ``ratio`` is ``p50_ms /
ceiling_p50_ms``: how many times the bare transport's latency a handoff takes.

``--pipeline CONFIG`` adds the handoff of a real pipeline
(:mod:`vllm_kvbridge.bench.handoff_pipeline`).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_kvbridge.models.model_args import add_model_arguments, chosen_model

#: Width of the payload's rows (the tiny model's hidden size, float32): 512 bytes a row.
ROW_DIM = 128
PATHS = ("get", "stage")
DEFAULT_SIZES = "1KB,64KB,1MB"


@dataclass
class Row:
    connector: str
    bytes: int
    p50_ms: float
    p99_ms: float
    #: ``get`` / ``stage`` (see the module docstring), or a pipeline measurement's name
    path: str
    ceiling_p50_ms: float
    ceiling_p99_ms: float
    ratio: float  # p50_ms / ceiling_p50_ms
    repeat: int
    idle_ms: float


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, nearest rank (the p99 of 100 values is the 99th)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def stage_payload(nbytes: int, request_id: str = "h") -> dict[str, Any]:
    """The envelope a payload sender puts for a payload whose rows take ``nbytes``."""
    from vllm_kvbridge.runner.payload_stream import FULL, make_envelope

    return make_envelope(FULL, request_id, payload_data(nbytes))


def payload_data(nbytes: int) -> dict[str, Any]:
    """A stage payload (hidden-state rows of ``nbytes``, rounded to whole rows, and token ids)."""
    rows = max(1, nbytes // (ROW_DIM * 4))
    gen = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(rows, ROW_DIM, generator=gen), "token_ids": list(range(8))}


def data_bytes(data: dict[str, Any]) -> int:
    rows = data["hidden_states"]
    return int(rows.numel() * rows.element_size())


# -- the receiver process -------------------------------------------------------------
def _receiver(name: str, config: dict[str, Any], pipe: Any) -> None:
    from vllm_kvbridge.connectors import create_connector
    from vllm_kvbridge.connectors.keys import payload_key
    from vllm_kvbridge.runner.payload_receiver import PayloadReceiver

    conn = create_connector(name, config)
    receiver: PayloadReceiver | None = None
    try:
        while True:
            msg = pipe.recv()
            if msg is None:
                break
            rid, metadata, path = msg
            if path == "stage":
                if receiver is None:
                    receiver = PayloadReceiver(conn, 0, 1, recv_timeout_s=60.0)
                receiver.expect(rid, metadata=metadata)
                pipe.send("waiting")
                data = receiver.result(rid, timeout=60.0)
            else:
                pipe.send("waiting")
                key = payload_key(rid, 0, 1)
                data = conn.get(0, 1, key, metadata, deadline=time.monotonic() + 60.0)["data"]
            done = time.perf_counter()
            nbytes = data_bytes(data)
            # Drop the views before answering: shared memory's segment goes back to the
            # sender's pool before its next put, as when a consumer is done with it.
            del data
            pipe.send((done, nbytes))
    finally:
        if receiver is not None:
            receiver.close()
        conn.close()


# -- measurements ---------------------------------------------------------------------
def idle_sampler(idle_ms: float, seed: int = 0) -> Callable[[], float]:
    """Seconds to sleep before a put: uniform in [0.5, 1.5] x ``idle_ms`` (0: none)."""
    rng = random.Random(seed)
    return lambda: idle_ms * rng.uniform(0.5, 1.5) / 1e3 if idle_ms > 0 else 0.0


class Handoff:
    """A sender (this process) and a receiver process of one connector, reused for every
    path and size (a context manager)."""

    def __init__(self, name: str, config: dict[str, Any] | None = None) -> None:
        from vllm_kvbridge.bench.connectors import _connector_config
        from vllm_kvbridge.connectors import create_connector

        self.name = name
        config = config if config is not None else _connector_config(name)
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._proc = ctx.Process(target=_receiver, args=(name, config, child), daemon=True)
        self._proc.start()
        self._conn = create_connector(name, config)
        self._sender: Any = None
        self._count = 0

    def __enter__(self) -> Handoff:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def measure(self, path: str, nbytes: int, repeat: int, idle_ms: float) -> list[float]:
        """Seconds from put start to a usable object on the receiver, ``repeat`` handoffs
        through ``path`` after a warm-up."""
        from vllm_kvbridge.connectors.keys import payload_key
        from vllm_kvbridge.runner.payload_stream import FULL, PayloadSender, make_envelope

        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if path == "stage" and self._sender is None:
            self._sender = PayloadSender(self._conn, 0, 1)
        sender = self._sender if path == "stage" else None
        # What a consumer is told before any put, as a pipeline forwards it: the sender's
        # address (ZMQ) and, for a stage's sender, its doorbell.
        metadata = (sender.receiver_info() if sender is not None else self._conn.receiver_metadata()) or None
        data = payload_data(nbytes)
        expected = data_bytes(data)
        idle = idle_sampler(idle_ms)
        times: list[float] = []
        for i in range(repeat + 1):
            self._count += 1
            rid = f"handoff{self._count}"
            self._pipe.send((rid, metadata, path))
            if self._pipe.recv() != "waiting":
                raise RuntimeError("the receiver process answered out of turn")
            time.sleep(idle())
            if sender is not None:
                start = time.perf_counter()
                sender.send_full(rid, data)
            else:
                envelope = make_envelope(FULL, rid, data)
                start = time.perf_counter()
                result = self._conn.put(0, 1, payload_key(rid, 0, 1), envelope)
                if not result.ok:
                    raise RuntimeError(f"{self.name} put failed: {result.error}")
            done, got = self._pipe.recv()
            if got != expected:
                raise RuntimeError(f"{self.name} delivered {got} bytes of rows, sent {expected}")
            if sender is not None:
                _settle(sender, rid)
            if i:  # the first handoff warms pools, sockets and page tables
                times.append(done - start)
        return times

    def close(self) -> None:
        try:
            if self._proc.is_alive():
                self._pipe.send(None)
                self._proc.join(30)
        finally:
            if self._sender is not None:
                self._sender.close()
            self._conn.close()
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()


def _settle(sender: Any, rid: str) -> None:
    """Wait until the sender's I/O thread has recorded the put (it returns after the
    receiver may already hold the payload), then forget it."""
    end = time.monotonic() + 30
    while sender.in_flight(rid) and time.monotonic() < end:
        time.sleep(0.0005)
    sender.forget(rid)


def ceiling_times(name: str, nbytes: int, repeat: int, idle_ms: float) -> list[float]:
    """The bare transport's one-way times for ``name`` (empty: no ceiling known for it)."""
    from vllm_kvbridge.bench.connectors import shm_ceiling_times, zmq_ceiling_times

    if name == "SharedMemoryConnector":
        return shm_ceiling_times(nbytes, repeat, idle_sampler(idle_ms, seed=1))
    if name == "ZmqConnector":
        return zmq_ceiling_times(nbytes, repeat, idle_sampler(idle_ms, seed=1))
    return []


def make_row(
    connector: str, path: str, nbytes: int, times: Sequence[float], ceiling: Sequence[float], idle_ms: float
) -> Row:
    p50, p99 = statistics.median(times) * 1e3, percentile(times, 0.99) * 1e3
    c50 = statistics.median(ceiling) * 1e3 if ceiling else float("nan")
    c99 = percentile(ceiling, 0.99) * 1e3 if ceiling else float("nan")
    return Row(connector, nbytes, p50, p99, path, c50, c99, p50 / c50, len(times), idle_ms)


def run_handoff_bench(
    connectors: Sequence[str],
    sizes: Sequence[int],
    repeat: int = 200,
    idle_ms: float = 20.0,
    paths: Sequence[str] = PATHS,
) -> list[Row]:
    """Every connector x size x path; one :class:`Row` each, with the ceiling of the same run."""
    from vllm_kvbridge.connectors.registry import canonical_name

    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    points: dict[tuple[int, str, str], Row] = {}
    for raw_name in connectors:
        name = canonical_name(raw_name)
        with Handoff(name) as handoff:
            for size in sizes:
                nbytes = data_bytes(payload_data(size))
                ceiling = ceiling_times(name, nbytes, repeat, idle_ms)
                for path in paths:
                    times = handoff.measure(path, nbytes, repeat, idle_ms)
                    points[(size, raw_name, path)] = make_row(raw_name, path, nbytes, times, ceiling, idle_ms)
    # printed by size, then connector: the connectors side by side
    return [points[(size, c, p)] for size in sizes for c in connectors for p in paths]


def format_table(rows: Sequence[Row]) -> str:
    """One line per row; ``x ceil`` is ``ratio`` (p50 over the bare transport's p50)."""
    width = max([len("path"), *(len(r.path) for r in rows)])
    header = (
        f"{'connector':<10} {'path':<{width}} {'bytes':>9} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'ceil p50':>9} {'ceil p99':>9} {'x ceil':>7} {'n':>5}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.connector:<10} {r.path:<{width}} {r.bytes:>9} {r.p50_ms:>9.3f} {r.p99_ms:>9.3f} "
            f"{r.ceiling_p50_ms:>9.3f} {r.ceiling_p99_ms:>9.3f} {r.ratio:>7.2f} {r.repeat:>5}"
        )
    return "\n".join(lines)


def write_json(rows: Sequence[Row], path: str) -> None:
    from vllm_kvbridge.bench.connectors import write_json as write_rows

    write_rows(rows, path)


# -- command line ---------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connectors", default="shm,zmq", help="comma-separated names or aliases (default: shm,zmq)"
    )
    p.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma-separated sizes, binary units (default: {DEFAULT_SIZES})",
    )
    p.add_argument(
        "--paths",
        default=",".join(PATHS),
        help="receive paths: get (Connector.get with a deadline), "
        "stage (PayloadSender -> PayloadReceiver, as stages run); default: both",
    )
    p.add_argument(
        "--repeat", type=int, default=200, help="timed handoffs per point, after one warm-up (default 200)"
    )
    p.add_argument(
        "--idle-ms",
        type=float,
        default=20.0,
        help="the receiver waits 0.5x-1.5x this long before each put (default 20: about a decode step)",
    )
    p.add_argument(
        "--pipeline",
        metavar="CONFIG",
        help="also measure a real pipeline's stage-to-stage handoff (e.g. "
        "stage_configs/thinker_talker_full_payload.yaml; starts its engines: about a minute)",
    )
    p.add_argument(
        "--requests", type=int, default=20, help="--pipeline: timed requests, one at a time (default 20)"
    )
    add_model_arguments(
        p, "--pipeline: model for its LLM stages that name none (default: the tiny offline model)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")


def run(args: argparse.Namespace) -> list[Row]:
    """Parse, measure (the connectors, then ``--pipeline`` if given); ValueError on bad arguments."""
    from vllm_kvbridge.bench.connectors import parse_size

    connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not connectors or not sizes or args.repeat < 1 or args.idle_ms < 0 or args.requests < 1:
        raise ValueError("need a connector, a size, --repeat >= 1, --requests >= 1 and --idle-ms >= 0")
    bad = [p for p in paths if p not in PATHS]
    if bad or not paths:
        raise ValueError(f"--paths: choose from {', '.join(PATHS)}, got {args.paths!r}")
    rows = run_handoff_bench(connectors, sizes, args.repeat, args.idle_ms, paths)
    if args.pipeline:
        from vllm_kvbridge.bench.handoff_pipeline import run_pipeline_handoff

        model = chosen_model(args)
        pipeline = run_pipeline_handoff(args.pipeline, args.requests, args.repeat, args.idle_ms, model=model)
        rows.extend(pipeline)
    return rows
