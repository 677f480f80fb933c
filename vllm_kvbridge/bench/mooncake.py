"""Mooncake pieces of ``vllm-kvbridge bench connectors``.

* :func:`connector_config`: the MooncakeStoreConnector config of the benchmark, from
  ``KVB_MOONCAKE_MASTER`` / ``KVB_MOONCAKE_METADATA`` (a running master), else a master
  this process starts on free loopback ports (:func:`local_master`, stopped at exit).
* :func:`measure_mooncake_ceiling`: Mooncake's own Python API moving the same bytes
  between two processes (``MooncakeDistributedStore.put`` here, ``get`` + ``remove`` in a
  receiver process), the ceiling our connector is compared with in the same run.
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


def measure_mooncake_ceiling(nbytes: int, repeat: int, config: dict[str, Any] | None = None) -> float:
    """GB/s of Mooncake's own ``put`` (this process) + ``get`` (another process) of ``nbytes``.

    Same master, same segment placement as the connector bench (the putting client's own
    segment holds the object). Median over ``repeat`` transfers after one warm-up.
    """
    from mooncake.store import ReplicateConfig

    config = config or connector_config()
    local_buffer = max(16 << 20, 1 << (nbytes + (1 << 20)).bit_length())  # put/get copy through it
    store = _raw_store(config, local_buffer)
    rc_config = ReplicateConfig()
    rc_config.preferred_segment = store.get_hostname()
    rc_config.with_hard_pin = True
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_receiver, args=(config, local_buffer, child), daemon=True)
    proc.start()
    data = os.urandom(1 << 20) * (nbytes >> 20) + os.urandom(nbytes & ((1 << 20) - 1))
    times = []
    try:
        for i in range(repeat + 1):
            key = f"{config['namespace']}/raw{i}"
            start = time.perf_counter()
            rc = store.put(key, data, rc_config)
            if rc != 0:
                raise RuntimeError(f"Mooncake raw put of {nbytes} bytes failed: {rc}")
            parent.send(key)
            _, done, got = parent.recv()
            if got != nbytes:
                raise RuntimeError(f"Mooncake raw get returned {got} bytes, put {nbytes}")
            if i:
                times.append(done - start)
        parent.send(None)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        store.close()
    return nbytes / statistics.median(times) / 1e9
