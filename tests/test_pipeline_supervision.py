"""The restart policy of supervised stages (``pipeline/supervision.py``): backoff, the
per-window budget, what ends the pipeline; and the ``runtime`` settings that feed it.
Real stage processes being lost and restarted: ``test_serve_supervision.py``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_kvbridge.config.resolve import resolve
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.results import StageError
from vllm_kvbridge.pipeline.stage_handles import kill_stage_group
from vllm_kvbridge.pipeline.supervision import (
    MAX_BACKOFF_S,
    RestartPolicy,
    StageSupervision,
    heartbeat_interval,
)

ROOT = Path(__file__).resolve().parent.parent
ERR = StageError(1, "diffusion", "process exited with status -9 (no output)")


def test_backoff_doubles_within_the_window_and_is_capped() -> None:
    sup = StageSupervision(RestartPolicy(max_restarts=10, window_s=1000.0, backoff_s=1.0))
    delays = [sup.lost(ERR, now=float(t)) for t in range(1, 8)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S]
    assert sup.restarts == 7 and sup.recovering and sup.last_error is ERR


def test_the_budget_is_per_window_and_refills() -> None:
    sup = StageSupervision(RestartPolicy(max_restarts=2, window_s=100.0, backoff_s=1.0))
    assert sup.lost(ERR, now=10.0) == 1.0
    sup.recovered()
    assert sup.lost(ERR, now=20.0) == 2.0
    sup.recovered()
    assert sup.lost(ERR, now=30.0) is None  # a third loss within 100 s: the budget is spent
    final = sup.exhausted(ERR)
    assert final.stage_id == 1 and "2 restart(s) in the last 100 s (runtime.max_restarts: 2)" in final.error
    assert final.error.startswith(ERR.error)
    # once the first leaves the window, a restart is allowed again (backoff as for a second)
    fresh = StageSupervision(RestartPolicy(max_restarts=2, window_s=100.0, backoff_s=1.0))
    fresh.lost(ERR, now=10.0), fresh.recovered(), fresh.lost(ERR, now=20.0), fresh.recovered()
    assert fresh.lost(ERR, now=115.0) == 2.0  # only the one at 20 s is still in the window
    assert fresh.restarts == 3


def test_no_restarts_means_the_first_loss_ends_the_pipeline() -> None:
    sup = StageSupervision(RestartPolicy(max_restarts=0))
    assert sup.lost(ERR, now=1.0) is None and not sup.recovering
    assert sup.exhausted(ERR).error == f"{ERR.error} (not restarted: runtime.max_restarts is 0)"


def test_recovery_hands_back_what_waited_and_clears_the_state() -> None:
    sup = StageSupervision(RestartPolicy(backoff_s=0.5))
    sup.lost(ERR, now=100.0)
    assert not sup.due(100.4) and sup.due(100.5)
    waiting = [m.Submit("a"), m.Submit("b")]
    sup.pending.extend(waiting)
    sup.restart_at = 0.0  # spawned
    assert not sup.due(1e9)  # nothing more to spawn while its process starts
    assert sup.recovered() == waiting
    assert not sup.recovering and sup.pending == []


def test_heartbeats_are_several_per_timeout() -> None:
    assert heartbeat_interval(RestartPolicy(heartbeat_timeout_s=30.0)) == 5.0
    assert heartbeat_interval(RestartPolicy(heartbeat_timeout_s=6.0)) == 1.0
    assert heartbeat_interval(RestartPolicy(heartbeat_timeout_s=0.01)) == 0.05


def test_runtime_settings_reach_the_plan_and_bad_ones_are_refused(tmp_path: Path) -> None:
    text = (ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text()
    path = tmp_path / "c.yaml"
    path.write_text(
        text + "runtime: {max_restarts: 5, restart_window: 60, restart_backoff: 2, heartbeat_timeout: 9}\n"
    )
    plan = resolve(path)
    assert (plan.max_restarts, plan.restart_window, plan.restart_backoff, plan.heartbeat_timeout) == (
        5,
        60,
        2,
        9,
    )
    assert resolve(ROOT / "stage_configs/ar_to_dit_shm.yaml").max_restarts == 3  # the default
    for bad, where in (
        ("max_restarts: -1", "runtime.max_restarts"),
        ("heartbeat_timeout: 0", "runtime.heartbeat_timeout"),
    ):
        path.write_text(text + f"runtime: {{{bad}}}\n")
        with pytest.raises(ConfigError, match=where):
            resolve(path)


def test_killing_a_stage_group_removes_the_shared_memory_only_it_mapped(tmp_path: Path) -> None:
    """What a killed vLLM engine leaves (its ``psm_*`` queues, and the ``sem.mp-*`` of a
    semaphore of Python's spawn context, mapped under glibc's temporary name and linked to
    its own afterwards) is removed with its group; a name another live process still maps
    stays."""
    own, shared = f"psm_kvbtest_{time.monotonic_ns()}", f"psm_kvbtest_shared_{time.monotonic_ns()}"
    code = (
        "import mmap, os, sys, time\n"
        "maps = []\n"
        "for n in sys.argv[1:]:\n"
        "    fd = os.open('/dev/shm/' + n, os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)\n"
        "    maps.append(mmap.mmap(fd, 4096))\n"
        "import multiprocessing\n"
        "sem = multiprocessing.get_context('spawn').Semaphore() if len(sys.argv) > 2 else None\n"
        "print('ready', 'sem' + sem._semlock.name.replace('/', '.') if sem else '', flush=True)\n"
        "time.sleep(600)\n"
    )
    group = subprocess.Popen(
        [sys.executable, "-c", code, own, shared], stdout=subprocess.PIPE, start_new_session=True
    )
    other = subprocess.Popen([sys.executable, "-c", code, shared], stdout=subprocess.PIPE)
    sem = ""
    try:
        assert group.stdout is not None and other.stdout is not None
        ready, sem = group.stdout.readline().decode().split()
        assert ready == "ready" and sem.startswith("sem.mp-") and Path(f"/dev/shm/{sem}").exists()
        assert other.stdout.readline().strip() == b"ready"
        removed = kill_stage_group(group.pid)
        assert group.wait(timeout=10) == -9
        assert removed == sorted([own, sem])
        assert not Path(f"/dev/shm/{own}").exists() and not Path(f"/dev/shm/{sem}").exists()
        assert Path(f"/dev/shm/{shared}").exists()
    finally:
        for p in (group, other):
            p.kill()
            p.wait()
        for n in (own, shared, sem):
            if n:
                Path(f"/dev/shm/{n}").unlink(missing_ok=True)


def test_the_exit_cause_is_the_signal_or_the_exception_never_a_stray_log_line() -> None:
    """Issue 36: a killed stage's 502/503 and /health quoted whatever it logged last (e.g.
    a warning); now the signal that killed it, or the exception of its last traceback."""
    from vllm_kvbridge.pipeline.stage_handles import exit_cause

    log = "INFO starting\nWARNING libtcmalloc is not found in LD_PRELOAD\n"
    assert exit_cause(-9, log) == "killed by SIGKILL"
    assert exit_cause(-15, "") == "killed by SIGTERM"
    crashed = (
        log + 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "    boom()\nRuntimeError: out of blocks\nWARNING shutting down\n"
    )
    assert exit_cause(1, crashed) == "RuntimeError: out of blocks"
    assert exit_cause(3, log) == "no error in its log"
