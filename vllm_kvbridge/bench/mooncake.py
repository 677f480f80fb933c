"""Mooncake pieces of ``vllm-kvbridge bench connectors``.

* :func:`connector_config`: the MooncakeStoreConnector config of the benchmark, from
  ``KVB_MOONCAKE_MASTER`` / ``KVB_MOONCAKE_METADATA`` (a running master), else a master
  this process starts on free loopback ports (:func:`local_master`, stopped at exit).
* :class:`StoreProbe`: Mooncake's own Python API moving
  the same bytes between two processes (``MooncakeDistributedStore.put`` here, ``get`` +
  ``remove`` in a receiver process), the ceiling our connector is compared with, sampled
  between the connector's transfers.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

from vllm_kvbridge.connectors.mooncake_master import ENV_PREFIX, MooncakeMaster

_master: MooncakeMaster | None = None


def local_master(timeout: float = 30.0) -> MooncakeMaster:
    """A ``mooncake_master`` on free loopback ports, started once per process, stopped at exit."""
    global _master
    if _master is None or not _master.running():
        master = MooncakeMaster().start(timeout)
        atexit.register(master.close)
        _master = master
    return _master


def connector_config(segment_bytes: int = 2 << 30) -> dict[str, Any]:
    master = os.environ.get(f"{ENV_PREFIX}_MASTER")
    metadata = os.environ.get(f"{ENV_PREFIX}_METADATA")
    if not (master and metadata):
        local = local_master()
        master, metadata = local.master_address, local.metadata_server
    return {
        "master_server_address": master,
        "metadata_server": metadata,
        "local_hostname": "127.0.0.1",
        "global_segment_size": segment_bytes,
        "protocol": "tcp",
        "namespace": f"bench{os.getpid()}",
    }


def _raw_store(config: dict[str, Any], local_buffer: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1",
        config["metadata_server"],
        config["global_segment_size"],
        local_buffer,
        "tcp",
        "",
        config["master_server_address"],
    )
    if rc != 0:
        raise RuntimeError(f"Mooncake setup failed: {rc}")
    return store


def _raw_receiver(config: dict[str, Any], local_buffer: int, pipe: Any) -> None:
    store = _raw_store({**config, "global_segment_size": 0}, local_buffer)
    try:
        while True:
            key = pipe.recv()
            if key is None:
                break
            start = time.perf_counter()
            data = store.get(key)
            done = time.perf_counter()
            store.remove(key, True)
            pipe.send((done - start, done, len(data)))
            del data
    finally:
        store.close()


class StoreProbe:
    """Mooncake's own ``put`` (this process) + ``get`` (a receiver process) of ``nbytes``,
    one transfer per :meth:`sample`: the connector bench samples it right before every
    connector transfer (a ceiling measured under the same load, with its spread), instead
    of in a separate run where a shared machine's load can differ (the row read 0.58x to
    1.48x of a ceiling measured apart). Same master, same placement as the connector (the
    putting client's own segment holds the object, hard-pinned)."""

    def __init__(self, nbytes: int, config: dict[str, Any] | None = None) -> None:
        from mooncake.store import ReplicateConfig

        self.nbytes = nbytes
        self._config = config or connector_config()
        local_buffer = max(16 << 20, 1 << (nbytes + (1 << 20)).bit_length())  # put/get copy through it
        self._store = _raw_store(self._config, local_buffer)
        self._rc = ReplicateConfig()
        self._rc.preferred_segment = self._store.get_hostname()
        self._rc.with_hard_pin = True
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._proc = ctx.Process(target=_raw_receiver, args=(self._config, local_buffer, child), daemon=True)
        self._proc.start()
        self._data = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
        self.samples: list[float] = []

    def sample(self) -> float:
        """Seconds of one raw put + get of ``nbytes``, appended to ``samples``."""
        key = f"{self._config['namespace']}/raw{len(self.samples)}"
        start = time.perf_counter()
        rc = self._store.put(key, self._data, self._rc)
        if rc != 0:
            raise RuntimeError(f"Mooncake raw put of {self.nbytes} bytes failed: {rc}")
        self._pipe.send(key)
        _, done, got = self._pipe.recv()
        if got != self.nbytes:
            raise RuntimeError(f"Mooncake raw get returned {got} bytes, put {self.nbytes}")
        self.samples.append(done - start)
        return done - start

    def gbps(self) -> float:
        """Median GB/s of the samples so far."""
        return self.nbytes / statistics.median(self.samples) / 1e9

    def close(self) -> None:
        try:
            self._pipe.send(None)
            self._proc.join(60)
        except (OSError, EOFError):
            pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._store.close()
