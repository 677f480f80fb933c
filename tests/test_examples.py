"""Every script under ``examples/`` runs (issue 38: ``offline_inference/ar_to_dit.py`` had
failed at import since ``encode_png`` moved, and nothing noticed).

The offline-inference scripts run here as a user runs them (a subprocess from the repository
root, the tiny model); the custom runner is a module the stage config names, run by
``test_pipeline_custom_runner.py``. A new file under ``examples/`` fails
:func:`test_every_example_is_run_by_a_test` until a test runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Example -> the test module that runs it (this one for the scripts below).
RUN_BY = {
    "examples/offline_inference/ar_to_dit.py": "tests/test_examples.py",
    "examples/offline_inference/thinker_talker.py": "tests/test_examples.py",
    "examples/custom_runner/step_logits_runner.py": "tests/test_pipeline_custom_runner.py",
}


def test_every_example_is_run_by_a_test() -> None:
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*.py")}
    assert found == set(RUN_BY), "an example no test runs (or a stale entry): add it to RUN_BY and run it"
    for example, test in RUN_BY.items():
        assert example.rpartition("/")[2].removesuffix(".py") in (ROOT / test).read_text(), (example, test)


def _run(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.engine
@pytest.mark.long(300, "the example starts its own pipeline of vLLM engines")
@pytest.mark.slow
def test_ar_to_dit_example_paints_one_png_per_prompt(tmp_path: Path) -> None:
    out = tmp_path / "out"
    stdout = _run(
        "examples/offline_inference/ar_to_dit.py",
        "--config",
        str(ROOT / "stage_configs/ar_to_dit_shm.yaml"),
        "--out",
        str(out),
        cwd=tmp_path,
    )
    pngs = sorted(out.glob("*.png"))
    assert len(pngs) == 2
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    lines = [line for line in stdout.splitlines() if " KV bytes in " in line]
    prompts = [line.split(":")[0] for line in lines]
    assert prompts == ["'A cute cat'", "'A diffusion transformer paints the moon'"]


@pytest.mark.engine
@pytest.mark.long(300, "the example starts its own pipeline of vLLM engines")
@pytest.mark.slow
def test_thinker_talker_example_prints_both_stages(tmp_path: Path) -> None:
    stdout = _run(
        "examples/offline_inference/thinker_talker.py",
        "--config",
        str(ROOT / "stage_configs/thinker_talker_full_payload.yaml"),
        cwd=tmp_path,
    )
    lines = [line for line in stdout.splitlines() if "thinker said" in line]
    assert [line.split(":")[0] for line in lines] == ["'A cute cat'", "'Once upon a time'"]
    assert all("talker said" in line for line in lines)
