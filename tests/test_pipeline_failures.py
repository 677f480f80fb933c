"""A stage that crashes on start ends `run` with that stage's error, quickly; one that dies
mid-run fails the prompts in it (the supervisor restarts it) or, with no restart allowed,
ends the run. Nothing is left behind: no stage process, no shared-memory segment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_fixtures import ROOT, STAGE_ENV, processes_using, run_id_in, run_names

from vllm_kvbridge.models.tiny_lm import ensure_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _config(tmp: Path, class_path: str, runtime: str = "") -> Path:
    text = (ROOT / "stage_configs/ar_to_dit_shm.yaml").read_text()
    text = text.replace("class_path: vllm_kvbridge.models.tiny_dit.TinyKVDiT", f"class_path: {class_path}")
    text += f"runtime: {{{runtime}}}\n" if runtime else ""
    path = tmp / "faulty.yaml"
    path.write_text(text)
    return path


def _run(config: Path, out: Path, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, **STAGE_ENV}
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_kvbridge.cli.main",
            "run",
            "--stage-config",
            str(config),
            "--prompt",
            "A cute cat",
            "--model",
            str(ensure_tiny_model()),
            "--output-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return proc, time.monotonic() - t0


@pytest.mark.forked
@pytest.mark.timeout(120)
def test_stage_crashing_on_start_fails_run_within_seconds(tmp_path: Path) -> None:
    tmp = tmp_path
    proc, took = _run(_config(tmp, "pipeline_fixtures.CrashOnInit"), tmp / "out", 100)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith(
        "error: stage 1 (diffusion) failed: failed to start: RuntimeError: injected start-up failure"
    ), proc.stderr
    # the LLM stage was still starting (~40 s here): it was stopped, not waited for
    assert took < 30, took
    assert "ready" not in proc.stdout.split("[stage 0 (llm_ar)] starting")[1].split("\n")[0]
    assert processes_using(tmp) == []  # every stage (and vLLM child) wrote its log under tmp
    # Only this run's names count: other runs on the machine come and go meanwhile.
    assert run_names(run_id_in(proc.stdout)) == set()


@pytest.mark.forked
@pytest.mark.long(240, "`run` through the CLI: a vLLM engine starts, the DiT dies and is restarted")
def test_stage_dying_mid_run_fails_the_prompt_in_it(tmp_path: Path) -> None:
    """Supervised (the default): the prompt in the dead stage fails naming it, the run
    still writes its results and exits 1 (a request failed), not 3 (the pipeline failed)."""
    tmp = tmp_path
    proc, took = _run(_config(tmp, "pipeline_fixtures.DieInForward"), tmp / "out", 220)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: request req-1: stage 1 (diffusion) failed: process exited with status 17" in proc.stderr
    assert "[stage 1 (diffusion)] LOST: process exited with status 17" in proc.stdout
    assert "restart 1 of 3 (per 600 s)" in proc.stdout
    result = json.loads((tmp / "out" / "result.json").read_text())
    assert [r["request_id"] for r in result["requests"]] == ["req-1"]
    assert "stage 1 (diffusion) failed" in result["requests"][0]["error"]
    assert took < 150, took
    assert processes_using(tmp) == []
    assert run_names(run_id_in(proc.stdout)) == set()


@pytest.mark.forked
@pytest.mark.long(240, "`run` through the CLI: a vLLM engine starts, the DiT dies")
def test_stage_dying_mid_run_without_restarts_fails_run_with_its_status(tmp_path: Path) -> None:
    tmp = tmp_path
    proc, took = _run(_config(tmp, "pipeline_fixtures.DieInForward", "max_restarts: 0"), tmp / "out", 220)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("error: stage 1 (diffusion) failed: process exited with status 17"), proc.stderr
    assert first.endswith("(not restarted: runtime.max_restarts is 0)"), proc.stderr
    # the LLM stage finished the request; the DiT died on its first forward
    assert "[stage 0 (llm_ar)] req-1 done" in proc.stdout
    assert not (tmp / "out" / "result.json").exists()
    assert took < 150, took
    assert processes_using(tmp) == []
    # Only this run's names count: other runs on the machine come and go meanwhile.
    assert run_names(run_id_in(proc.stdout)) == set()
