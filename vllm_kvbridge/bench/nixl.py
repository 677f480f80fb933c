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

import os
import time
from typing import Any

import numpy as np

from vllm_kvbridge.bench.source_probe import SourceProbe
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


class NixlReadProbe(SourceProbe):
    """Times raw NIXL READs of ``nbytes`` from another process (see the module docstring)."""

    what = "NIXL"

    def __init__(self, nbytes: int, *, timeout_s: float = 120.0) -> None:
        self.ucx_env = prepare_ucx_env()
        self._agent: Any = None
        super().__init__(nbytes, _source, (nbytes,), timeout_s)

    def _connect(self, info: Any) -> None:
        metadata, self._remote_addr = info
        api = import_nixl()
        config = api.nixl_agent_config(backends=["UCX"])
        self._agent = new_agent(api, f"kvbridge-bench-dst-{os.getpid()}", config)
        self._dst = np.zeros(self.nbytes, dtype=np.uint8)
        self._reg = self._agent.register_memory([(self._dst.ctypes.data, self.nbytes, 0, "")], "DRAM")
        self._peer = self._agent.add_remote_agent(metadata)

    def _read(self) -> float:
        """One READ with a notification to the source (descriptors made outside the time)."""
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
        return elapsed

    def _release(self) -> None:
        agent, self._agent = self._agent, None
        if agent is not None:
            if getattr(self, "_peer", None) is not None:
                agent.remove_remote_agent(self._peer)
            if getattr(self, "_reg", None) is not None:
                agent.deregister_memory(self._reg)
            del agent


__all__ = ["NixlReadProbe"]
