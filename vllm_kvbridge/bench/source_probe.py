"""The raw-engine ceilings' common shape: a spawned source process whose engine holds the
payload's bytes in registered memory, read by this process with the engine's own API.

:class:`SourceProbe` owns the source process and the pipe to it: the source's first message
says how to reach its memory (:meth:`SourceProbe._connect` takes it); ``"write"`` makes it
copy the payload into its registered buffer and answer the seconds that took (a payload is
not in registered memory until somebody puts it there: the connector's put is that copy);
``None`` stops it (it answers once more). :meth:`SourceProbe.sample` is one write plus one
read (:meth:`SourceProbe._read`, timed by the subclass around the engine's calls only),
appended to ``samples``; the read alone to ``read_samples``. The transfer engine's and
NIXL's probes (:mod:`~vllm_kvbridge.bench.mooncake_te`, :mod:`~vllm_kvbridge.bench.nixl`)
differ only in how they connect, read and let go.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
from collections.abc import Callable
from typing import Any


class SourceProbe:
    """A source process of ``nbytes`` and this process's reader (see the module docstring)."""

    #: Names the engine in errors.
    what = "raw engine"

    def __init__(
        self, nbytes: int, source: Callable[..., None], args: tuple[Any, ...], timeout_s: float
    ) -> None:
        self.nbytes = nbytes
        self.timeout_s = timeout_s
        self.samples: list[float] = []
        self.read_samples: list[float] = []
        ctx = mp.get_context("spawn")
        self._pipe, child = ctx.Pipe()
        self._proc = ctx.Process(target=source, args=(*args, child), daemon=True)
        self._proc.start()
        try:
            if not self._pipe.poll(60):
                raise RuntimeError(f"the {self.what} bench source process did not start")
            self._connect(self._pipe.recv())
        except BaseException:
            self.close()
            raise

    def _connect(self, info: Any) -> None:
        """Set up this side's engine and buffer from the source's first message."""
        raise NotImplementedError

    def _read(self) -> float:
        """Read the source's ``nbytes`` once; the seconds the engine took."""
        raise NotImplementedError

    def _release(self) -> None:
        """Let go of this side's engine (it may be half set up). Idempotent."""

    def sample(self) -> float:
        """Seconds of one write into the source's registered buffer plus one read of it."""
        self._pipe.send("write")
        if not self._pipe.poll(self.timeout_s):
            raise RuntimeError(f"the {self.what} bench source did not write its buffer")
        written = self._pipe.recv()
        elapsed = self._read()
        self.read_samples.append(elapsed)
        self.samples.append(written + elapsed)
        return written + elapsed

    def gbps(self) -> float:
        """Median GB/s of the samples so far."""
        return self.nbytes / statistics.median(self.samples) / 1e9

    def close(self) -> None:
        self._release()
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

    def __enter__(self) -> SourceProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["SourceProbe"]
