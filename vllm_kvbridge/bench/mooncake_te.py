"""Mooncake transfer-engine pieces of ``vllm-kvbridge bench connectors``: the raw-engine ceiling.

:class:`TeReadProbe` is Mooncake's own Python API (``mooncake.engine.TransferEngine``, no
kvbridge code on the data path) doing the read the connector's receiver does, on the same
number of bytes and with the same split (``PIECE_BYTES`` pieces in batches of
``MAX_BATCH_PIECES``, the connector's defaults): another (spawned) process holds a
registered, pre-faulted source buffer; this process reads it into its own registered,
pre-faulted buffer over the same transport (TCP here). Before each read the source writes
the bytes into its registered buffer (one copy, as fast as this package copies:
:mod:`~vllm_kvbridge.wire.parallel_copy`; a payload is not in registered memory until
somebody puts it there, and the connector's put is that copy). :meth:`TeReadProbe.sample`
times the write plus the read, ``read_samples`` the read alone (the ceiling of the
connector's ``get``); the connector bench samples it right before every connector
transfer, so ceiling and connector see the same load on a shared machine. What the
connector adds on top (encode, claim and confirm over its control socket, decode) is what
the ratio shows. The NIXL probe is built the same way (:mod:`vllm_kvbridge.bench.nixl`).
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from vllm_kvbridge.connectors.mooncake_te import MAX_BATCH_PIECES, PIECE_BYTES
from vllm_kvbridge.wire import parallel_copy


def _engine(protocol: str) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    if rc != 0:
        raise RuntimeError(f"Mooncake transfer engine initialize failed: {rc}")
    return engine


def _source(nbytes: int, protocol: str, pipe: Any) -> None:
    """Child: an engine with ``nbytes`` registered; waits until told to stop."""
    engine = _engine(protocol)
    buf = np.ones(nbytes, dtype=np.uint8)  # written: faulted in before timing
    payload = np.full(nbytes, 7, dtype=np.uint8)  # the bytes to put there, faulted in too
    if engine.register_memory(buf.ctypes.data, nbytes) != 0:
        raise RuntimeError("register_memory failed in the bench source")
    pipe.send((f"127.0.0.1:{engine.get_rpc_port()}", buf.ctypes.data))
    while pipe.recv() is not None:  # "write": the payload into registered memory
        start = time.perf_counter()
        parallel_copy.memmove(buf.ctypes.data, payload.ctypes.data, nbytes)
        pipe.send(time.perf_counter() - start)
    engine.unregister_memory(buf.ctypes.data)
    pipe.send("bye")


class TeReadProbe:
    """Times raw transfer-engine reads of ``nbytes`` from another process (see the module docstring)."""

    def __init__(self, nbytes: int, *, protocol: str = "tcp") -> None:
        self.nbytes = nbytes
        self.protocol = protocol
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._proc = ctx.Process(target=_source, args=(nbytes, protocol, child), daemon=True)
        self._proc.start()
        self._engine: Any = None
        try:
            if not self._pipe.poll(60):
                raise RuntimeError("the transfer-engine bench source process did not start")
            self._segment, self._remote = self._pipe.recv()
            self._engine = _engine(protocol)
            self._dst = np.ones(nbytes, dtype=np.uint8)
            if self._engine.register_memory(self._dst.ctypes.data, nbytes) != 0:
                raise RuntimeError("register_memory failed in the bench reader")
        except BaseException:
            self.close()
            raise
        self.samples: list[float] = []
        self.read_samples: list[float] = []

    def sample(self) -> float:
        """Seconds of one write of ``nbytes`` into the source's registered buffer plus one
        read of them, appended to ``samples`` (the read alone to ``read_samples``)."""
        self._pipe.send("write")
        if not self._pipe.poll(60):
            raise RuntimeError("the transfer-engine bench source did not write its buffer")
        written = self._pipe.recv()
        engine, dst, src, n = self._engine, self._dst.ctypes.data, self._remote, self.nbytes
        offsets = list(range(0, n, PIECE_BYTES))
        start = time.perf_counter()
        for first in range(0, len(offsets), MAX_BATCH_PIECES):
            batch = offsets[first : first + MAX_BATCH_PIECES]
            lengths = [min(PIECE_BYTES, n - off) for off in batch]
            if len(batch) == 1:
                rc = engine.transfer_sync_read(self._segment, dst + batch[0], src + batch[0], lengths[0])
            else:
                rc = engine.batch_transfer_sync_read(
                    self._segment, [dst + o for o in batch], [src + o for o in batch], lengths
                )
            if rc != 0:
                raise RuntimeError(f"raw transfer-engine read of {n} bytes failed: {rc}")
        elapsed = time.perf_counter() - start
        self.read_samples.append(elapsed)
        self.samples.append(written + elapsed)
        return written + elapsed

    def gbps(self) -> float:
        """Median GB/s of the samples so far."""
        return self.nbytes / statistics.median(self.samples) / 1e9

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self._dst.ctypes.data)
            del engine
        try:
            self._pipe.send(None)
            if self._pipe.poll(30):
                self._pipe.recv()
        except (OSError, EOFError):
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def __enter__(self) -> TeReadProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure_te_ceiling(nbytes: int, repeat: int) -> float:
    """GB/s (median of ``repeat`` after one warm-up) of a raw transfer-engine read of ``nbytes``."""
    with TeReadProbe(nbytes) as probe:
        probe.sample()
        probe.samples.clear()
        for _ in range(repeat):
            probe.sample()
        return probe.gbps()


__all__ = ["TeReadProbe", "measure_te_ceiling"]
