"""``vllm-kvbridge bench soak`` (issue 15, item 6) on a real server it starts itself: load with
client aborts and a kill of the diffusion stage mid-load. Only what must hold whatever the
timing is asserted: every request is accounted for once, the only failures are the
requests the killed stage held (502), the stage came back, and nothing was left behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serve_fixtures import ROOT, SERVER_ENV

pytestmark = [pytest.mark.engine, pytest.mark.slow]
REQUESTS = 24


@pytest.mark.timeout(600)
def test_soak_with_aborts_and_a_kill_accounts_for_every_request(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, "-m", "vllm_kvbridge.cli.main", "bench", "soak"]
    argv += ["--stage-config", str(ROOT / "stage_configs/ar_to_dit_shm.yaml"), "--requests", str(REQUESTS)]
    argv += [
        "--concurrency",
        "4",
        "--abort-frac",
        "0.25",
        "--kill",
        "1@4",
        "--baseline",
        "2",
        "--json",
        str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=560, env={**os.environ, **SERVER_ENV})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    # A failure says what the server saw too (its log: the stage losses, restarts, errors).
    why = f"{r}\n--- server log (tail) ---\n{_server_log_tail(proc.stdout)}"
    assert r["ok"] + r["aborted"] + sum(r["failed"].values()) == REQUESTS, why
    assert set(r["failed"]) <= {"502"}, why  # lost with the stage; a 503 meanwhile is retried
    assert r["ok"] > 0 and r["baseline_s"] > 0 and r["p50_ratio"] > 0
    (kill,) = r["kills"]
    assert kill["stage_id"] == 1 and kill["pid"] > 0 and kill["recovery_s"] is not None, why
    left = r["leftovers"]
    assert left["in_flight"] == 0 and left["published_unread"] == 0, left
    assert left["server_exit"] == 0 and left["shm_after_stop"] == 0 and left["vllm_queues_after_stop"] == 0, (
        left
    )
    assert "kill stage 1 at" in proc.stdout and "back in" in proc.stdout, proc.stdout


def _server_log_tail(stdout: str, lines: int = 80) -> str:
    """The last lines of the log of the server the soak started (it prints the path)."""
    match = re.search(r"starting the server \(log (.+?)\)", stdout)
    if match is None:
        return "(no server log named in the output)"
    path = Path(match.group(1))
    return (
        "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        if path.exists()
        else f"({path} is gone)"
    )
