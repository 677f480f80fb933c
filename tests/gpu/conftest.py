"""tests/gpu runs only where CUDA is visible: without a device the run fails at once (a
GPU suite that skipped everything would read as a pass). A test here skips only for a
stated hardware reason (e.g. "needs a second GPU"); ``-rs`` lists those in the summary."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.exit("tests/gpu: CUDA is not visible (torch.cuda.is_available() is False)", returncode=2)
