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
the ratio shows. The NIXL probe is built the same way (:mod:`vllm_kvbridge.bench.nixl`;
both on :class:`~vllm_kvbridge.bench.source_probe.SourceProbe`).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from vllm_kvbridge.bench.source_probe import SourceProbe
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


class TeReadProbe(SourceProbe):
    """Times raw transfer-engine reads of ``nbytes`` from another process (see the module docstring)."""

    what = "transfer-engine"

    def __init__(self, nbytes: int, *, protocol: str = "tcp", timeout_s: float = 60.0) -> None:
        self.protocol = protocol
        self._engine: Any = None
        super().__init__(nbytes, _source, (nbytes, protocol), timeout_s)

    def _connect(self, info: Any) -> None:
        self._segment, self._remote = info
        self._dst = np.ones(self.nbytes, dtype=np.uint8)
        self._engine = _engine(self.protocol)
        if self._engine.register_memory(self._dst.ctypes.data, self.nbytes) != 0:
            raise RuntimeError("register_memory failed in the bench reader")

    def _read(self) -> float:
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
        return time.perf_counter() - start

    def _release(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self._dst.ctypes.data)
            del engine


__all__ = ["TeReadProbe"]
