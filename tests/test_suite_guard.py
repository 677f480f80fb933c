"""The suite guard (tests/suite_guard.py) reports what a run leaves in /dev/shm and in its
temp dir and engines started by tests not marked ``engine``, naming the test, and counts
nothing another process made: run on tests/guard_probe/probe_guard.py in a pytest subprocess,
with and without xdist."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parent / "guard_probe" / "probe_guard.py"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.timeout(90)
def test_the_guard_reports_what_a_run_leaves_and_only_that(tmp_path: Path, workers: int) -> None:
    shm_name = f"psm_{secrets.token_hex(6)}"
    foreign = f"psm_{secrets.token_hex(6)}"
    env = {k: v for k, v in os.environ.items() if k not in ("KVBRIDGE_SUITE_TMP", "PYTEST_XDIST_WORKER")}
    namespace = f"gp{secrets.token_hex(4)}"
    env.update(TMPDIR=str(tmp_path), PROBE_SHM_NAME=shm_name, PROBE_FOREIGN_NAME=foreign)
    env["PROBE_NAMESPACE"] = namespace
    env["KVBRIDGE_GUARD_ENGINE_TITLE"] = "KVBPROBE::EngineCore"  # not a real engine to this run
    env["KVBRIDGE_STRICT_LEFTOVERS"] = "1"
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "python_files=probe_*.py"]
    argv += ["-n", str(workers), str(PROBE)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=80, cwd=PROBE.parents[2])
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out  # every probe test passed: only the guard failed the run
        assert "7 passed" in out, out
        report = out.split("what the suite left or started unmarked")[1]
        lines = [line for line in report.splitlines() if line.startswith(("left ", "started "))]
        assert len(lines) == 4, report
        assert any(
            f"left /dev/shm/kvbridge.{namespace}.p." in ln and "a process of the run" in ln for ln in lines
        )
        assert any(f"left /dev/shm/{shm_name}: " in ln and "test_leaves_a_shm_name" in ln for ln in lines)
        assert any("/kvb-probe-" in ln and ln.endswith("test_leaves_a_temp_dir") for ln in lines)
        assert any(
            "without @pytest.mark.engine" in ln and "test_starts_an_engine_unmarked" in ln for ln in lines
        )
        assert foreign not in report and "kvb-tidy-" not in report
        # reported, then removed: the run's name and its temp directory (the foreign name stays)
        assert not os.path.exists(f"/dev/shm/{shm_name}")
        assert os.path.exists(f"/dev/shm/{foreign}")
        assert list(tmp_path.iterdir()) == []
        assert not [n for n in os.listdir("/dev/shm") if namespace in n]  # reported, then removed
    finally:
        for name in (shm_name, foreign):
            Path(f"/dev/shm/{name}").unlink(missing_ok=True)
        for name in [n for n in os.listdir("/dev/shm") if namespace in n]:
            os.unlink(f"/dev/shm/{name}")
