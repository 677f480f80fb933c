"""A real ``mooncake_master`` (with its embedded HTTP metadata server) for tests.

The launcher is the package's :class:`vllm_kvbridge.connectors.mooncake_master.MooncakeMaster`
(free loopback ports, waits until it answers, stops by process group, dies with the
process that started it). This module only adds the pytest side.

The ``mooncake_master`` fixture is function-scoped on purpose: tests run ``--forked``,
and a session fixture would be set up again (and never torn down) in every forked child.
It also exports the addresses as ``KVB_TEST_MOONCAKE_*`` environment variables, which
spawned children inherit; :func:`env_config` reads them (connectors take plain values).

Imports nothing from Mooncake's Python binding: only the master binary is used here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from vllm_kvbridge.connectors.mooncake_master import MooncakeMaster, free_port, keys_at

ENV_PREFIX = "KVB_TEST_MOONCAKE"
ENV_MASTER = f"{ENV_PREFIX}_MASTER"
ENV_METADATA = f"{ENV_PREFIX}_METADATA"
ENV_ADMIN = f"{ENV_PREFIX}_ADMIN"


def keys_in_env_master(prefix: str) -> list[str]:
    """Keys under ``prefix`` on the master named by ``$KVB_TEST_MOONCAKE_ADMIN`` (works in children)."""
    return keys_at(os.environ[ENV_ADMIN], prefix)


def env_config(namespace: str, **overrides: Any) -> dict[str, Any]:
    """Connector config that finds the test master through the environment (read now, so it
    works in spawned children too: they inherit the variables)."""
    return {
        "master_server_address": os.environ[ENV_MASTER],
        "metadata_server": os.environ[ENV_METADATA],
        "local_hostname": "127.0.0.1",
        "namespace": namespace,
        "global_segment_size": "1536MiB",
        "protocol": "tcp",
        **overrides,
    }


@pytest.fixture
def mooncake_master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A running master for one test; stopped by pid afterwards (and dies with the test process)."""
    master = MooncakeMaster(log_dir=tmp_path)
    master.start()
    for name, value in master.env(ENV_PREFIX).items():
        monkeypatch.setenv(name, value)
    try:
        yield master
    finally:
        master.stop()


__all__ = ["MooncakeMaster", "env_config", "free_port", "keys_in_env_master", "mooncake_master"]
