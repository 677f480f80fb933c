"""Engine settings under which hidden-state capture cannot be exact are refused at start.

Real ``VllmConfig`` objects from vLLM's own ``EngineArgs`` on the tiny model (no engine is
started: the check runs in the runner's constructor, before any forward).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvbridge.errors import ConfigError


def _config(model_dir: Path, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=512, **kwargs)
    return args.create_engine_config()


def test_capture_refuses_speculative_decoding(tiny_model_dir: Path) -> None:
    # Issue 11, case 14: draft rows that the verifier rejects would end up in the payload.
    from vllm_kvbridge.runner.ar_runner import check_capture_supported

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    with pytest.raises(ConfigError, match=r"speculative decoding.*ngram"):
        check_capture_supported(_config(tiny_model_dir, speculative_config=spec))
    check_capture_supported(_config(tiny_model_dir))  # the plain engine is fine
