"""Whether a stage's engine makes progress: what its heartbeat reports (issue 36, item 2).

A heartbeat proves the stage process runs; it proves nothing about the vLLM engine core and
workers, which are other processes. :class:`EngineLiveness` adds two views of them, and
each :class:`~vllm_kvbridge.pipeline.messages.Heartbeat` carries the longer of the two as
``stalled_s`` (with the reason), so the orchestrator's supervision treats an engine stalled
for ``heartbeat_timeout`` like a stage that stopped beating: killed and restarted
(:meth:`~vllm_kvbridge.pipeline.supervision.StageSupervision.check`).

* Stopped processes: a descendant of the stage process (engine core, worker, diffusion rank)
  in a stopped state (SIGSTOP, a tracer), for as long as it has been seen so. This also
  catches an engine stopped while the stage is idle. While one is stopped, the reason names
  it (it explains a wait on the engine too), whichever view has lasted longer.
* Steps: the serve loop marks each of its turns (:meth:`turn`); a turn that does not end
  means it waits on the engine (a step, an RPC). It counts as stalled only while the engine's
  processes make no steps either (the :mod:`~vllm_kvbridge.runner.progress` board, written by
  our KV connector in the engine core and each worker), so a step that waits on purpose (a
  talker fed per step, whose engine core keeps stepping until its rows arrive) is not a
  stall, while a deadlocked or wedged engine process is. An engine with no board (a
  diffusion or vocoder stage: their work runs in threads of the stage process) counts the
  wait alone; their serve loop never waits for long.
"""

from __future__ import annotations

import mmap
import os
import time

from vllm_kvbridge import procfs
from vllm_kvbridge.runner.progress import read_ages

__all__ = ["MIN_STALL_S", "EngineLiveness"]

#: Shorter waits are steps in progress (an idle serve loop's turn lasts up to its poll
#: interval), reported as no stall at all.
MIN_STALL_S = 0.5


class EngineLiveness:
    """The serve loop's turns and the engine's processes, as the heartbeat thread sees them."""

    def __init__(self, board: mmap.mmap | None = None, root_pid: int | None = None) -> None:
        self._board = board
        self._root = os.getpid() if root_pid is None else root_pid
        #: start of the serve loop's current turn; 0.0 until the engine serves
        self._turn_at = 0.0
        #: ``{pid: first seen stopped}`` of the descendants seen stopped at the last look
        self._stopped: dict[int, float] = {}

    def turn(self) -> None:
        """The serve loop starts a turn (called from its thread only; one store)."""
        self._turn_at = time.monotonic()

    def stall(self, now: float | None = None) -> tuple[float, str]:
        """``(seconds, why)`` the engine has made no progress; ``(0.0, "")`` while it does
        (and before the serve loop's first turn: a starting engine has ``start_timeout``)."""
        if not self._turn_at:
            return 0.0, ""
        now = time.monotonic() if now is None else now
        stalled, why = self._waiting(now)
        stopped, how = self._stopped_for(now)
        if how:
            # A stopped process is the cause of any wait on the engine, so it is what the
            # reason names, however the two are timed: a wait may have begun before the
            # heartbeat thread first saw the stop (a stats RPC sent just after it).
            stalled, why = max(stalled, stopped), how
        return (stalled, why) if stalled >= MIN_STALL_S else (0.0, "")

    def _waiting(self, now: float) -> tuple[float, str]:
        waited = now - self._turn_at
        ages = read_ages(self._board, now) if self._board is not None else {}
        if not ages:
            return waited, f"its serve loop has waited {waited:.1f} s on the engine"
        pid, age = max(ages.items(), key=lambda item: item[1])
        stalled = min(waited, age)
        return stalled, f"engine process {pid} made no step for {age:.1f} s while the stage waited on it"

    def _stopped_for(self, now: float) -> tuple[float, str]:
        seen, states = {}, {}
        for pid in procfs.descendants(self._root):
            state = procfs.state(pid)
            if state is not None and state in procfs.STOPPED_STATES:
                seen[pid], states[pid] = self._stopped.get(pid, now), state
        self._stopped = seen
        if not seen:
            return 0.0, ""
        pid, since = min(seen.items(), key=lambda item: item[1])
        return now - since, f"engine process {pid} stopped (state {states[pid]}) for {now - since:.1f} s"
