"""The GPU checks cannot pass without a GPU (issue 35, item 8): ``make test-gpu`` /
``make gpu-check`` (scripts/gpu_check.py) and tests/gpu itself fail, saying CUDA is not
visible, where it is not - here, always."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_gpu_check_fails_saying_cuda_is_not_visible() -> None:
    for args in (["--no-pipelines"], []):
        proc = _run("scripts/gpu_check.py", *args)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "CUDA is not visible" in proc.stderr


def test_the_gpu_suite_fails_instead_of_skipping() -> None:
    proc = _run("-m", "pytest", "-p", "no:cacheprovider", "-q", "tests/gpu", KVBRIDGE_GPU_TESTS="1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "CUDA is not visible" in proc.stdout + proc.stderr
    assert " passed" not in proc.stdout and " skipped" not in proc.stdout
