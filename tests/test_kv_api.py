"""The KV layer's public surface: one import path, the reference design's methods, one job per module."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import vllm_kvbridge.kv as kv_pkg

KV_DIR = Path(kv_pkg.__file__).parent

#: The manager API of the seed design (docs/architecture.md, kv/): every name stays callable.
PUBLIC_METHODS = (
    "handle_finished_requests_kv_transfer",
    "get_finished",
    "get_sender_info",
    "forget_sender_info",
    "pending_sends",
    "update_sender_info",
    "receive_kv_cache_for_request",
    "receive_multi_kv_cache",
    "receive_multi_kv_cache_distributed",
    "distribute_kv_cache",
    "role",
    "pop_received",
    "start_prefetch",
    "consume_and_distribute_kv_cache",
    "topology",
    "health",
    "shutdown",
    "from_vllm_config",
    "from_stage_config",
)


def test_package_exports_the_manager_of_the_manager_module() -> None:
    from vllm_kvbridge.kv import (
        KVPrefetchConsumeError,
        KVTransferConfig,
        KVTransferManager,
        ReceivedKV,
        config,
        manager,
    )

    assert KVTransferManager is manager.KVTransferManager
    assert KVPrefetchConsumeError is manager.KVPrefetchConsumeError
    assert ReceivedKV is manager.ReceivedKV
    assert KVTransferConfig is config.KVTransferConfig
    for name in PUBLIC_METHODS:
        assert callable(getattr(KVTransferManager, name)), name
    for name in ("connector", "send_stages", "recv_stages", "prefetcher"):
        assert isinstance(inspect.getattr_static(KVTransferManager, name), property), name


def test_kv_config_import_does_not_pull_in_the_manager() -> None:
    # The config layer and runner settings import kv.config at start-up; the manager (and
    # torch) must only load when used.
    code = (
        "import sys; import vllm_kvbridge.kv.config; "
        "assert 'vllm_kvbridge.kv.manager' not in sys.modules; "
        "from vllm_kvbridge.kv import KVTransferManager; "
        "assert 'vllm_kvbridge.kv.manager' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_kv_module_over_600_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in KV_DIR.glob("*.py")}
    assert {n: s for n, s in sizes.items() if s > 600} == {}
