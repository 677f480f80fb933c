"""Mooncake transfer-engine pieces of ``vllm-kvbridge bench connectors``: the raw-engine ceiling.

:class:`TeReadProbe` is Mooncake's own Python API (``mooncake.engine.TransferEngine``, no
kvbridge code on the data path) doing the read the connector's receiver does, on the same
number of bytes and with the same split (``PIECE_BYTES`` pieces in batches of
``MAX_BATCH_PIECES``, the connector's defaults): another (spawned) process holds a
registered, pre-faulted source buffer; this process reads it into its own registered,
pre-faulted buffer over the same transport (TCP here). :meth:`TeReadProbe.sample` times one
read; the connector bench samples it right before every connector transfer, so ceiling and
connector see the same load on a shared machine. What the connector adds on top (pack into
its slab, claim and confirm over its control socket, decode, first-touch of a new slab) is
what the ratio shows.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from vllm_kvbridge.connectors.mooncake_te import MAX_BATCH_PIECES, PIECE_BYTES


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
    if engine.register_memory(buf.ctypes.data, nbytes) != 0:
        raise RuntimeError("register_memory failed in the bench source")
    pipe.send((f"127.0.0.1:{engine.get_rpc_port()}", buf.ctypes.data))
    pipe.recv()
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

    def sample(self) -> float:
        """Seconds of one read of the source's ``nbytes``, appended to ``samples``."""
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
        self.samples.append(elapsed)
        return elapsed

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
