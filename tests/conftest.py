"""Fixtures shared by every test area.

Area-specific fixtures live in ``tests/<area>_fixtures.py`` and are pulled in by the
test modules that need them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# No VLLM_CPU_KVCACHE_SPACE here: it would override the KV cache size every stage gets
# (config/cpu_kv_cache.py); engines a test starts itself size theirs the same way.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tests/gpu needs a CUDA device and runs through `make test-gpu` / `make gpu-check`
# (scripts/gpu_check.py sets KVBRIDGE_GPU_TESTS=1), where a missing device is a failure, not
# a skip. `make test` runs on machines without one and leaves the folder out.
collect_ignore = [] if os.environ.get("KVBRIDGE_GPU_TESTS") == "1" else ["gpu"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny random-weight Llama model (seed 0), built once per test session."""
    from vllm_kvbridge.models.tiny_lm import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


_SESSION_PID = os.getpid()


@pytest.fixture(autouse=True)
def _fork_safe_torch() -> None:
    """In a ``@pytest.mark.forked`` child, run torch single-threaded.

    The parent may already have started OpenMP's thread pool, which does not survive
    ``fork``: the child's first parallel region can hang. One thread is always safe.
    """
    if os.getpid() != _SESSION_PID:
        import torch

        torch.set_num_threads(1)
