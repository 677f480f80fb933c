"""``vllm-kvbridge bench connectors``: connector throughput against ceilings of the same run.

For each connector and size, a sender (this process) puts a KV-shaped payload (up to 28
layers x K/V x ``[tokens, 4, 128]`` bfloat16) and a receiver in a separate (spawned)
process gets it. Times (median of ``repeat`` after one warm-up):

* ``put_s``: the sender's put; ``get_s``: the receiver's get (from being told the key to
  holding the tensors, which are zero-copy views for both built-in connectors);
* ``e2e_s`` (p50) and ``e2e_p99_s``: from the start of the put to the receiver holding
  the tensors, including the notification over a pipe (both sides read the same
  ``CLOCK_MONOTONIC``).

Ceilings, measured in the same run on the same bytes:

* ``memcpy_gbps``: one in-process copy of the payload's tensors, tensor by tensor, into
  one pre-faulted buffer: the least work any one-copy transport does for this payload.
  It is timed right before every transfer (same samples, same load on a shared
  machine) and the median is used.
* ``memcpy_blob_gbps``: one ``memcpy`` of a single contiguous blob of the same size,
  timed the same way. It can be much faster than the per-tensor copy: glibc switches to
  non-temporal stores only above a size threshold derived from the L3 size (~100 MB on
  a VM reporting a 260 MB L3), which a payload of 56 tensors never reaches per call.
  ``blob_ratio`` is ``gbps / memcpy_blob_gbps``.
* ``ceiling_gbps``, the transport's own: for ZMQ a bare pyzmq send/recv of one frame
  between two processes over TCP loopback; for shared memory one write into and one
  read out of an already-mapped segment, in two processes. Connectors listed in
  :data:`CEILING_PROBES` (the Mooncake store, one-sided engines) get a raw probe (the
  store's own put + get, the engine's own read) that is sampled right
  before every transfer, interleaved like the memcpy (``ceiling_min_gbps`` /
  ``ceiling_max_gbps`` give its spread; ``gbps_min`` / ``gbps_max`` the connector's).
"""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from vllm_kvbridge.wire import parallel_copy

_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
_HEADS, _HEAD_DIM, _LAYERS = 4, 128, 28
_PER_TOKEN_LAYER = 2 * _HEADS * _HEAD_DIM * 2  # K and V, bfloat16


def parse_size(text: str) -> int:
    """``"64MB"`` -> 67108864 (binary units: KB=1024, MB=1024**2, GB=1024**3)."""
    t = text.strip().upper()
    for unit in ("GB", "MB", "KB", "B"):
        if t.endswith(unit):
            number = t[: -len(unit)]
            break
    else:
        unit, number = "B", t
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"bad size {text!r} (examples: 64KB, 1MB, 512MB, 1GB)") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def kv_payload(nbytes: int) -> dict[str, Any]:
    """A KV-cache-shaped payload of about ``nbytes`` bytes."""
    layers = max(1, min(_LAYERS, nbytes // _PER_TOKEN_LAYER))
    tokens = max(1, nbytes // (layers * _PER_TOKEN_LAYER))
    gen = torch.Generator().manual_seed(0)

    def one() -> torch.Tensor:
        return torch.randint(
            -(1 << 15), 1 << 15, (tokens, _HEADS, _HEAD_DIM), generator=gen, dtype=torch.int16
        ).view(torch.bfloat16)

    return {"key_cache": [one() for _ in range(layers)], "value_cache": [one() for _ in range(layers)]}


def payload_bytes(payload: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for side in payload.values() for t in side)


@dataclass
class Row:
    connector: str
    bytes: int
    put_s: float
    get_s: float
    e2e_s: float
    e2e_p99_s: float
    gbps: float
    memcpy_gbps: float
    ratio: float
    ceiling_gbps: float
    ceiling_ratio: float
    memcpy_blob_gbps: float
    blob_ratio: float
    gbps_min: float = float("nan")
    gbps_max: float = float("nan")
    ceiling_min_gbps: float = float("nan")
    ceiling_max_gbps: float = float("nan")
    #: the connector's get against the raw engine's read alone (NIXL: its READ), where the
    #: probe times one (``read_samples``): the receive side's own ceiling
    get_ratio: float = float("nan")


#: Raw-engine ceilings sampled between transfers: ``"module:Class"``, the class taking the
#: byte count and offering ``sample() -> seconds``, ``samples``, ``gbps()`` and ``close()``.
CEILING_PROBES: dict[str, str] = {
    "MooncakeStoreConnector": "vllm_kvbridge.bench.mooncake:StoreProbe",
    "MooncakeTransferEngineConnector": "vllm_kvbridge.bench.mooncake_te:TeReadProbe",
    "NixlConnector": "vllm_kvbridge.bench.nixl:NixlReadProbe",
}


def connector_unavailable(name: str) -> str | None:
    """Why the bench connector ``name`` (``mooncake``, ``mooncake-te``, ``nixl``; the others
    need nothing optional) cannot run here: its engine is not installed. None when it can."""
    try:
        if name == "mooncake":
            import mooncake.store

            from vllm_kvbridge.connectors.mooncake_master import master_binary

            master_binary()
        elif name == "mooncake-te":
            import mooncake.engine  # noqa: F401
        elif name == "nixl":
            from vllm_kvbridge.connectors.nixl_agent import import_nixl

            import_nixl()
    except (ImportError, FileNotFoundError) as exc:
        return f"{'NIXL' if name == 'nixl' else 'Mooncake'} is not installed here ({exc})"
    return None


def _ceiling_probe(name: str, nbytes: int) -> Any | None:
    ref = CEILING_PROBES.get(name)
    if ref is None:
        return None
    import importlib

    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)(nbytes)


# -- child processes ------------------------------------------------------------------
def _receiver(name: str, config: dict[str, Any], pipe: Any) -> None:
    from vllm_kvbridge.connectors import create_connector

    with create_connector(name, config) as conn:
        while True:
            msg = pipe.recv()
            if msg is None:
                break
            key, metadata = msg
            start = time.perf_counter()
            got = conn.get(0, 1, key, metadata, deadline=time.monotonic() + 120)
            done = time.perf_counter()
            nbytes = payload_bytes(got)
            # Drop the views before answering, so shared memory's segment is back in the
            # sender's pool before its next put (a real consumer releases them when done).
            del got
            pipe.send((done - start, done, nbytes))


def _zmq_sink(pipe: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    pipe.send(port)
    while True:
        frame = sock.recv(copy=False)
        done = time.perf_counter()
        if len(frame) == 0:
            break
        pipe.send(done)
        del frame
    sock.close(linger=0)
    ctx.term()


def _shm_reader(path: str, nbytes: int, pipe: Any) -> None:
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    os.close(fd)
    src = np.frombuffer(mm, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    dst[:] = 0  # fault the destination in before timing
    pipe.send("ready")
    while pipe.recv():
        np.copyto(dst, src)
        pipe.send(time.perf_counter())
    del src
    mm.close()


# -- measurements ---------------------------------------------------------------------
def _median_gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


class MemcpyProbe:
    """Times one-copy ceilings of a payload, so they can be sampled between transfers.

    :meth:`tensors` copies every tensor of the payload (``memmove``, as a one-copy
    transport does) into one pre-faulted buffer at 64-byte aligned offsets; :meth:`blob`
    copies one contiguous blob of the same size. Both return seconds. Both copy as the
    codec does (:func:`~vllm_kvbridge.wire.parallel_copy.memmove_many` /
    :func:`~vllm_kvbridge.wire.parallel_copy.memmove`: the bytes spread over several
    threads), so the ceiling is the best copy this process makes, not one core's.
    """

    def __init__(self, payload: dict[str, Any]) -> None:
        self.tensors_list = [t for side in payload.values() for t in side]
        self.nbytes = payload_bytes(payload)
        offsets, pos = [], 0
        for t in self.tensors_list:
            offsets.append(pos)
            pos += -(-t.nbytes // 64) * 64
        self.offsets = offsets
        self.dst = np.ones(max(pos, 1), dtype=np.uint8)  # written: faulted in before timing
        self.src_blob = np.ones(self.nbytes, dtype=np.uint8)
        self.dst_blob = np.ones(self.nbytes, dtype=np.uint8)

    def tensors(self) -> float:
        base = self.dst.ctypes.data
        copies = [(base + off, t.data_ptr(), t.nbytes) for off, t in zip(self.offsets, self.tensors_list)]
        start = time.perf_counter()
        parallel_copy.memmove_many(copies)
        return time.perf_counter() - start

    def blob(self) -> float:
        start = time.perf_counter()
        parallel_copy.memmove(self.dst_blob.ctypes.data, self.src_blob.ctypes.data, self.nbytes)
        return time.perf_counter() - start


def measure_zmq_ceiling(nbytes: int, repeat: int) -> float:
    return _median_gbps(nbytes, zmq_ceiling_times(nbytes, repeat))


def zmq_ceiling_times(nbytes: int, repeat: int, idle_s: Callable[[], float] | None = None) -> list[float]:
    """Seconds of ``repeat`` bare pyzmq sends of ``nbytes`` (one frame) over TCP loopback to
    a receiver blocked in ``recv`` in another process, after one warm-up; ``idle_s()``: how
    long to sleep before each send (a receiver that has waited a while)."""
    import zmq

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_zmq_sink, args=(child,), daemon=True)
    proc.start()
    zctx = zmq.Context()
    sock = zctx.socket(zmq.PAIR)
    try:
        sock.connect(f"tcp://127.0.0.1:{parent.recv()}")
        buf = np.ones(nbytes, dtype=np.uint8)
        times = []
        for _ in range(repeat + 1):
            if idle_s is not None:
                time.sleep(idle_s())
            start = time.perf_counter()
            sock.send(buf, copy=False)
            times.append(parent.recv() - start)
        sock.send(b"")
        proc.join(30)
    finally:
        sock.close(linger=0)
        zctx.term()
        if proc.is_alive():
            proc.kill()
            proc.join()
    return times[1:]


def measure_shm_ceiling(nbytes: int, repeat: int) -> float:
    return _median_gbps(nbytes, shm_ceiling_times(nbytes, repeat))


def shm_ceiling_times(nbytes: int, repeat: int, idle_s: Callable[[], float] | None = None) -> list[float]:
    """Seconds of ``repeat`` rounds of one write of ``nbytes`` into an already-mapped
    segment, a pipe message to a reader blocked on it in another process and its read out
    of the segment, after one warm-up; ``idle_s()`` as in :func:`zmq_ceiling_times`."""
    path = f"/dev/shm/kvbridge.bench{os.getpid()}.ceiling"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    proc = None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.close(fd)
        dst = np.frombuffer(mm, dtype=np.uint8)
        src = np.ones(nbytes, dtype=np.uint8)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_shm_reader, args=(path, nbytes, child), daemon=True)
        proc.start()
        assert parent.recv() == "ready"
        times = []
        for _ in range(repeat + 1):
            if idle_s is not None:
                time.sleep(idle_s())
            start = time.perf_counter()
            np.copyto(dst, src)
            parent.send(True)
            times.append(parent.recv() - start)
        parent.send(False)
        proc.join(30)
        del dst
        mm.close()
    finally:
        os.unlink(path)
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join()
    return times[1:]


def transport_ceiling_times(name: str, nbytes: int, repeat: int) -> list[float]:
    """Seconds of ``repeat`` moves of ``nbytes`` by the bare transport under connector
    ``name`` (after one warm-up): shared memory's and ZMQ's one-way trips, the raw-engine
    probes of :data:`CEILING_PROBES`; empty for a connector with no ceiling known."""
    if name == "SharedMemoryConnector":
        return shm_ceiling_times(nbytes, repeat)
    if name == "ZmqConnector":
        return zmq_ceiling_times(nbytes, repeat)
    probe = _ceiling_probe(name, nbytes)
    if probe is None:
        return []
    try:
        for _ in range(repeat + 1):
            probe.sample()
        return probe.samples[1:]
    finally:
        probe.close()


def _connector_config(name: str) -> dict[str, Any]:
    if name == "SharedMemoryConnector":
        return {"namespace": "bench" + uuid.uuid4().hex[:8]}
    if name == "ZmqConnector":
        return {"host": "127.0.0.1", "port": 0}
    if name == "MooncakeStoreConnector":
        from vllm_kvbridge.bench.mooncake import connector_config

        return connector_config()
    return {}


def measure_connector(
    name: str,
    payload: dict[str, Any],
    repeat: int,
    config: dict[str, Any] | None = None,
    probe: MemcpyProbe | None = None,
    ceiling: Any | None = None,
) -> tuple[float, float, list[float], list[float], list[float]]:
    """(median put_s, median get_s, e2e times, memcpy times, blob memcpy times) over ``repeat``
    transfers after a warm-up; the memcpy times (empty without ``probe``) are sampled right
    before each timed transfer, like ``ceiling.sample()`` when a raw-engine probe is given."""
    from vllm_kvbridge.connectors import create_connector, payload_key

    config = config if config is not None else _connector_config(name)
    nbytes = payload_bytes(payload)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(name, config, child), daemon=True)
    proc.start()
    puts, gets, e2e, copies, blobs = [], [], [], [], []
    try:
        with create_connector(name, config) as sender:
            for i in range(repeat + 1):
                if probe is not None and i:
                    copies.append(probe.tensors())
                    blobs.append(probe.blob())
                if ceiling is not None:
                    ceiling.sample()  # the first one warms the raw engine, like the connector's
                key = payload_key(f"bench{i}", 0, 1)
                start = time.perf_counter()
                result = sender.put(0, 1, key, payload)
                put_done = time.perf_counter()
                if not result.ok:
                    raise RuntimeError(f"{name} put failed: {result.error}")
                parent.send((key, result.metadata))
                get_s, done, got_bytes = parent.recv()
                if got_bytes != nbytes:
                    raise RuntimeError(f"{name} delivered {got_bytes} bytes, sent {nbytes}")
                if i:  # the first transfer warms pools, sockets and page tables
                    puts.append(put_done - start)
                    gets.append(get_s)
                    e2e.append(done - start)
            parent.send(None)
            proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return statistics.median(puts), statistics.median(gets), e2e, copies, blobs


def run_connector_bench(connectors: Sequence[str], sizes: Sequence[int], repeat: int = 5) -> list[Row]:
    """Measure every connector at every size; returns one :class:`Row` each."""
    from vllm_kvbridge.connectors.registry import canonical_name

    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    rows = []
    for size in sizes:
        payload = kv_payload(size)
        nbytes = payload_bytes(payload)
        probe = MemcpyProbe(payload)
        probe.tensors()
        probe.blob()  # warm-up
        for raw_name in connectors:
            name = canonical_name(raw_name)
            if name == "SharedMemoryConnector":
                ceiling = measure_shm_ceiling(nbytes, repeat)
            elif name == "ZmqConnector":
                ceiling = measure_zmq_ceiling(nbytes, repeat)
            else:
                ceiling = float("nan")
            raw = _ceiling_probe(name, nbytes)
            try:
                put_s, get_s, e2e, copies, blobs = measure_connector(
                    name, payload, repeat, probe=probe, ceiling=raw
                )
            finally:
                if raw is not None:
                    raw.close()
            spread: dict[str, float] = {
                "gbps_min": nbytes / max(e2e) / 1e9,
                "gbps_max": nbytes / min(e2e) / 1e9,
            }
            if raw is not None:
                raw_s = raw.samples[1:]
                ceiling = _median_gbps(nbytes, raw_s)
                spread.update(
                    ceiling_min_gbps=nbytes / max(raw_s) / 1e9, ceiling_max_gbps=nbytes / min(raw_s) / 1e9
                )
                if getattr(raw, "read_samples", None):
                    spread["get_ratio"] = statistics.median(raw.read_samples[1:]) / get_s
            e2e_s = statistics.median(e2e)
            gbps = nbytes / e2e_s / 1e9
            memcpy = _median_gbps(nbytes, copies)
            blob = _median_gbps(nbytes, blobs)
            p99 = sorted(e2e)[min(len(e2e) - 1, round(0.99 * (len(e2e) - 1)))]
            rows.append(
                Row(
                    raw_name,
                    nbytes,
                    put_s,
                    get_s,
                    e2e_s,
                    p99,
                    gbps,
                    memcpy,
                    gbps / memcpy,
                    ceiling,
                    gbps / ceiling,
                    blob,
                    gbps / blob,
                    **spread,
                )
            )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    header = (
        f"{'connector':<10} {'bytes':>12} {'put ms':>9} {'get ms':>9} {'e2e p50':>9} {'p99 ms':>9} "
        f"{'GB/s':>7} {'memcpy':>7} {'ratio':>6} {'ceiling':>8} {'c.ratio':>7} "
        f"{'blob':>7} {'b.ratio':>7} {'GB/s min-max':>13} {'ceil min-max':>13} {'get.r':>6}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        spread = f"{r.gbps_min:.2f}-{r.gbps_max:.2f}"
        ceiling_spread = f"{r.ceiling_min_gbps:.2f}-{r.ceiling_max_gbps:.2f}"
        lines.append(
            f"{r.connector:<10} {r.bytes:>12} {r.put_s * 1e3:>9.3f} {r.get_s * 1e3:>9.3f} "
            f"{r.e2e_s * 1e3:>9.3f} "
            f"{r.e2e_p99_s * 1e3:>9.3f} {r.gbps:>7.2f} {r.memcpy_gbps:>7.2f} {r.ratio:>6.2f} "
            f"{r.ceiling_gbps:>8.2f} {r.ceiling_ratio:>7.2f} {r.memcpy_blob_gbps:>7.2f} {r.blob_ratio:>7.2f} "
            f"{spread:>13} {ceiling_spread:>13} {r.get_ratio:>6.2f}"
        )
    return "\n".join(lines)


def write_json(rows: Sequence[Row], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=2)
        f.write("\n")
