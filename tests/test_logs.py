"""kvbridge's INFO lines reach stderr (so a stage's log), unless the application opts out."""

from __future__ import annotations

import os
import subprocess
import sys

SNIPPET = (
    "import logging, vllm_kvbridge; "
    "log = logging.getLogger('vllm_kvbridge.config.resolve'); "
    "log.info('chose %s', 'shm'); log.debug('details')"
)


def _stderr(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_KVBRIDGE_")}
    proc = subprocess.run(
        [sys.executable, "-c", SNIPPET], env={**environ, **env}, capture_output=True, text=True, check=True
    )
    return proc.stderr


def test_info_lines_go_to_stderr_in_vllms_style() -> None:
    err = _stderr()
    assert "INFO" in err and "[kvbridge <string>:1] chose shm" in err
    assert "details" not in err


def test_the_level_and_the_opt_out_are_environment_variables() -> None:
    assert "details" in _stderr(VLLM_KVBRIDGE_LOGGING_LEVEL="debug")
    assert _stderr(VLLM_KVBRIDGE_CONFIGURE_LOGGING="0") == ""  # Python's default shows no INFO
