"""NIXL pieces of ``vllm-kvbridge bench connectors``: the raw-agent ceiling of the NIXL connector.

:class:`NixlReadProbe` is NIXL's own Python API (``nixl._api.nixl_agent``, no kvbridge code
on the data path) moving a payload the way the connector must, on the same number of
bytes: another (spawned) process writes the bytes into its registered, pre-faulted source
buffer (one copy, as fast as this package copies: :mod:`~vllm_kvbridge.wire.parallel_copy`;
a payload is not in registered memory until somebody puts it there), and this process
READs them into its own registered, pre-faulted buffer with a notification back to the
source. :meth:`NixlReadProbe.sample` times the write plus the READ (post to DONE);
``read_samples`` keep the READ alone, the ceiling of the connector's ``get``. The
connector bench samples it right before every connector transfer, so ceiling and
connector see the same load on a shared machine. Both sides use the UCX environment the
connector sets (:func:`~vllm_kvbridge.connectors.nixl_agent.prepare_ucx_env`), so
``UCX_TLS`` is the same, and agents made as the connector makes them
(:func:`~vllm_kvbridge.connectors.nixl_agent.new_agent`: a progress thread that sleeps
when idle; NIXL's spinning default would take a core each from the connector it measures).

Why the write is in the ceiling: it was not, and the connector read 0.47-0.52x of "NIXL's
own READ" while its ``get`` matched the READ; the difference was exactly the copy into
registered memory that the raw READ was spared (shared memory's ceiling, one write and one
read of a segment, always had it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

from vllm_kvbridge.connectors.nixl_agent import import_nixl, new_agent, prepare_ucx_env
from vllm_kvbridge.wire import parallel_copy


def _source(nbytes: int, pipe: Any) -> None:
    """Child: a raw agent with ``nbytes`` registered; drains notifications until told to stop."""
    prepare_ucx_env()
    api = import_nixl()
    agent = new_agent(api, f"kvbridge-bench-src-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))
    buf = np.ones(nbytes, dtype=np.uint8)  # written: faulted in before timing
    payload = np.full(nbytes, 7, dtype=np.uint8)  # the bytes to put there, faulted in too
    reg = agent.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    pipe.send((agent.get_agent_metadata(), buf.ctypes.data))
    notes = 0
    while True:
        if pipe.poll(0.002):
            if pipe.recv() is None:
                break
            start = time.perf_counter()  # "write": the payload into registered memory
            parallel_copy.memmove(buf.ctypes.data, payload.ctypes.data, nbytes)
            pipe.send(time.perf_counter() - start)
        notes += sum(len(v) for v in agent.get_new_notifs().values())
    agent.deregister_memory(reg)
    pipe.send(notes)


class NixlReadProbe:
    """Times raw NIXL READs of ``nbytes`` from another process (see the module docstring)."""

    def __init__(self, nbytes: int, *, timeout_s: float = 120.0) -> None:
        self.nbytes = nbytes
        self.timeout_s = timeout_s
        self.ucx_env = prepare_ucx_env()
        api = import_nixl()
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._proc = ctx.Process(target=_source, args=(nbytes, child), daemon=True)
        self._proc.start()
        try:
            if not self._pipe.poll(60):
                raise RuntimeError("the NIXL bench source process did not start")
            metadata, self._remote_addr = self._pipe.recv()
            self._agent = new_agent(
                api, f"kvbridge-bench-dst-{os.getpid()}", api.nixl_agent_config(backends=["UCX"])
            )
            self._dst = np.zeros(nbytes, dtype=np.uint8)
            self._reg = self._agent.register_memory([(self._dst.ctypes.data, nbytes, 0, "")], "DRAM")
            self._peer = self._agent.add_remote_agent(metadata)
        except BaseException:
            self._stop_source()
            raise
        self.samples: list[float] = []
        self.read_samples: list[float] = []

    def sample(self) -> float:
        """Seconds of one write of ``nbytes`` into the source's registered buffer plus one
        READ of them (with a notification), appended to ``samples`` (the READ alone to
        ``read_samples``)."""
        self._pipe.send("write")
        if not self._pipe.poll(self.timeout_s):
            raise RuntimeError("the NIXL bench source did not write its buffer")
        written = self._pipe.recv()
        agent = self._agent
        local = agent.get_xfer_descs([(self._dst.ctypes.data, self.nbytes, 0)], "DRAM")
        remote = agent.get_xfer_descs([(self._remote_addr, self.nbytes, 0)], "DRAM")
        start = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, self._peer, b"bench")
        state = agent.transfer(handle)
        while state == "PROC":
            if time.perf_counter() - start > self.timeout_s:
                raise RuntimeError(f"raw NIXL READ of {self.nbytes} bytes took over {self.timeout_s} s")
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ of {self.nbytes} bytes failed: {state}")
        self.read_samples.append(elapsed)
        self.samples.append(written + elapsed)
        return written + elapsed

    def gbps(self) -> float:
        """Median GB/s of the samples so far."""
        return self.nbytes / statistics.median(self.samples) / 1e9

    def _stop_source(self) -> None:
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

    def close(self) -> None:
        agent, self._agent = getattr(self, "_agent", None), None
        if agent is not None:
            agent.remove_remote_agent(self._peer)
            agent.deregister_memory(self._reg)
            del agent
        self._stop_source()

    def __enter__(self) -> NixlReadProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["NixlReadProbe"]
