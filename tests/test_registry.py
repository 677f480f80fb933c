"""Connector registry: names, aliases, third-party factories, real import errors."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from vllm_kvbridge.connectors import registry
from vllm_kvbridge.connectors.base import Connector, PutResult
from vllm_kvbridge.errors import ConfigError, ConnectorClosed


class _DictConnector(Connector):
    """A minimal in-process connector: what a third-party plugin looks like."""

    name = "DictConnector"

    def __init__(self, config):
        super().__init__(config)
        self.store: dict = {}

    def put(self, from_stage, to_stage, key, payload):
        self._check_open()
        self.store[key] = payload
        return PutResult(ok=True, nbytes=0)

    def get(self, from_stage, to_stage, key, metadata=None, *, deadline=None):
        self._check_open()
        return self.store.pop(key, None)

    def cleanup(self, key):
        self.store.pop(key, None)

    def _close(self):
        self.store.clear()


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(registry, "_factories", dict(registry._BUILTINS))
    monkeypatch.setattr(registry, "_entry_points_loaded", True)


def test_register_and_create(clean_registry) -> None:
    registry.register_connector("dict", _DictConnector)
    with registry.create_connector("dict", {"a": 1}) as conn:
        assert conn.config == {"a": 1}
        assert conn.put(0, 1, "k", 5).ok
        assert conn.get(0, 1, "k") == 5
        assert conn.health()["connector"] == "DictConnector"
    assert conn.closed
    with pytest.raises(ConnectorClosed):
        conn.put(0, 1, "k", 5)
    conn.close()  # idempotent


def test_duplicate_registration_is_refused(clean_registry) -> None:
    registry.register_connector("dict", _DictConnector)
    with pytest.raises(ConfigError, match="already registered"):
        registry.register_connector("dict", _DictConnector)
    registry.register_connector("dict", _DictConnector, replace=True)


def test_unknown_name_lists_known_ones(clean_registry) -> None:
    with pytest.raises(ConfigError, match=r"unknown connector 'shmm'.*SharedMemoryConnector"):
        registry.create_connector("shmm")


def test_aliases_resolve() -> None:
    assert registry.canonical_name("shm") == "SharedMemoryConnector"
    assert registry.canonical_name("zmq") == "ZmqConnector"
    assert registry.canonical_name("mooncake") == "MooncakeStoreConnector"


def test_factory_must_return_a_connector(clean_registry) -> None:
    registry.register_connector("bad", lambda config: object())
    with pytest.raises(ConfigError, match="not a Connector"):
        registry.create_connector("bad")


def test_import_error_of_a_plugin_surfaces_as_itself(
    clean_registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_plugin.py").write_text("import no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register_connector("broken", "broken_plugin:Factory")
    with pytest.raises(ModuleNotFoundError, match="no_such_module_xyz"):
        registry.create_connector("broken")
    sys.modules.pop("broken_plugin", None)


def test_entry_point_plugins_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A real installed distribution (dist-info with entry_points.txt) on sys.path.
    dist = tmp_path / "kvb_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvb-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm_kvbridge.connectors]\nPluginConn = kvb_plugin_mod:PluginConnector\n"
    )
    (tmp_path / "kvb_plugin_mod.py").write_text(
        textwrap.dedent("""
        from vllm_kvbridge.connectors.base import Connector, PutResult

        class PluginConnector(Connector):
            name = "PluginConnector"

            def put(self, from_stage, to_stage, key, payload):
                return PutResult(ok=True)

            def get(self, from_stage, to_stage, key, metadata=None, *, deadline=None):
                return None

            def cleanup(self, key):
                pass

            def _close(self):
                pass
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_factories", dict(registry._BUILTINS))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    assert "PluginConn" in registry.available_connectors()
    with registry.create_connector("PluginConn") as conn:
        assert conn.name == "PluginConnector"
    sys.modules.pop("kvb_plugin_mod", None)


def test_remaining_never_negative() -> None:
    import time

    assert Connector.remaining(None) is None
    assert Connector.remaining(time.monotonic() - 5) == 0.0
    assert 0 < Connector.remaining(time.monotonic() + 5) <= 5
