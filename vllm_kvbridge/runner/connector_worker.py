"""``KVBridgeConnectorWorker``: the worker side of ``KVBridgeConnector``.

One per worker process. vLLM's runners (V1 GPU and CPU through ``initialize_kv_cache``, V2
through ``gpu/kv_connector.py``'s ``ActiveKVConnector``) hand it the paged caches in
``register_kv_caches``, where it builds its
:class:`~vllm_kvbridge.runner.kv_sender.WorkerKVSender`. After each step's forward
(``wait_for_save``) it gathers that step's sends from the caches, and reports the specs whose
blocks the scheduler held back in ``finished_sending`` (``get_finished``) once the gather
copied them. No model-runner hook is involved: a stock vLLM worker given only
``kv_transfer_config`` sends KV.

It never calls the runner. A kvbridge runner of a payload stage *takes* what each step's
metadata said (requests that ended, capture updates: :meth:`take_step_events`) after vLLM's
step ran the connector, and reads :attr:`kv_sender` for status and sender info.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_kvbridge.runner import progress
from vllm_kvbridge.runner.settings import RunnerSettings

if TYPE_CHECKING:
    from vllm_kvbridge.runner.capture import CaptureUpdate
    from vllm_kvbridge.runner.kv_sender import WorkerKVSender

logger = logging.getLogger(__name__)

#: What one step's metadata told a payload stage's runner: (internal id -> (``"finished"`` |
#: ``"aborted"``, transfer id), internal id -> capture update).
StepEvents = tuple[dict[str, tuple[str, str]], dict[str, "CaptureUpdate"]]


class KVBridgeConnectorWorker:
    """A worker's KV sender and the step events its runner takes (see the module docstring)."""

    def __init__(
        self, settings: RunnerSettings, vllm_config: Any, kv_cache_config: Any, block_size: int
    ) -> None:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # A KV-only stage runs vLLM's stock CPU worker; this is its first kvbridge code,
            # before the engine's first forward with the KV cache (vllm_compat.py says why).
            from vllm_kvbridge.runner.vllm_compat import request_amx_tiles

            request_amx_tiles()
        self.settings = settings
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.block_size = block_size
        self._sender: WorkerKVSender | None = None
        self._released: set[str] = set()
        self._lock = threading.Lock()
        # Only a payload stage has a kvbridge runner that takes these (its runner is
        # required, see ar_runner.initialize_kv_cache); it takes them after every step.
        self._keeps_events = bool(settings.payload.outputs)
        self._events: list[StepEvents] = []
        #: Wraps the transport the sender puts KV through (``Connector -> Connector``), set
        #: before the caches are registered: fault injection and instrumentation.
        self.wrap_transport: Callable[[Any], Any] | None = None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's runner registers its paged caches (once, after allocating them): build the
        sender now, so a broken transport fails the engine's start, not a request."""
        if not self.settings.sends_kv or not kv_caches:
            return
        from vllm_kvbridge.kv.layout_vllm import kv_cache_groups, layout_from_kv_cache_config
        from vllm_kvbridge.runner.kv_sender import (
            WorkerKVSender,
            kv_caches_in_layer_order,
            layer_groups_in_layer_order,
        )
        from vllm_kvbridge.runner.vllm_connector import tp_position

        tp_rank, tp_size, tp_group = tp_position()
        vllm_config = self._vllm_config
        groups = kv_cache_groups(self._kv_cache_config)
        # One gather reads every layer: the groups must page their K/V alike (sliding and
        # full layers of one model do; a model whose layer types differ in heads or head
        # size is refused here, at the engine's start, not at its first request).
        layouts = [
            layout_from_kv_cache_config(vllm_config, self._kv_cache_config, g) for g in range(len(groups))
        ]
        if any(layout != layouts[0] for layout in layouts[1:]):
            raise RuntimeError(
                f"KVBridgeConnector: the KV cache groups page their KV differently ({layouts}); "
                "kvbridge sends groups of one page format only"
            )
        if self._sender is not None:
            self._sender.shutdown()
        self._sender = WorkerKVSender(
            self.settings,
            kv_caches_in_layer_order(kv_caches),
            layouts[0],
            num_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
            block_size=self.block_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tp_group=tp_group,
            wrap_transport=self.wrap_transport,
            model=str(vllm_config.model_config.model),
            layer_groups=layer_groups_in_layer_order(kv_caches, groups) if len(groups) > 1 else None,
        )

    @property
    def kv_sender(self) -> WorkerKVSender | None:
        """This worker's KV sender (None before ``register_kv_caches`` or when it sends no KV)."""
        return self._sender

    def wait_for_save(self, meta: Any) -> None:
        """After the step's forward: gather this step's sends (and those held back while the
        send queue was full), and keep what ended for the runner. Never raises (an error
        here takes the engine down): a failed send reads ``failed: why`` in the sender's status."""
        sender = self._sender
        busy = sender is not None and (sender.held() or sender.copying())
        if not (meta.sends or meta.finished or meta.capture or busy):
            return
        released: set[str] = set()
        try:
            if sender is not None:
                sender.send(meta.sends, idle=meta.idle)
            elif meta.sends:
                # register_kv_caches never ran (or this stage sends no KV): nothing to gather.
                logger.error(
                    "KVBridgeConnector: %d KV send(s) scheduled but no KV caches were registered; they fail",
                    len(meta.sends),
                )
                released = {s.req_id for s in meta.sends if s.release}
            aborted = {rid: tid for rid, (kind, tid) in meta.finished.items() if kind == "aborted"}
            if aborted and sender is not None:
                sender.mark_aborted(aborted)
            if self._keeps_events and (meta.finished or meta.capture):
                with self._lock:
                    self._events.append((dict(meta.finished), dict(meta.capture)))
        finally:
            # Without a sender nothing can hold these blocks. A sender's own releases
            # (gathered, failed, withdrawn) are collected in get_finished, which vLLM calls
            # after this in every step.
            with self._lock:
                self._released.update(released)

    def take_step_events(self) -> list[StepEvents]:
        """What the steps since the last call said ended or was captured, oldest first (the
        runner calls this after each of vLLM's step calls)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def get_finished(self) -> set[str] | None:
        """Held blocks whose gather is done (vLLM 0.33's V2 with a drafter calls this before
        the step's ``wait_for_save``: its gathers are reported a step later, see vllm_compat.py)."""
        progress.touch()  # every step calls it, with or without a forward
        sender = self._sender
        if sender is not None:  # gathered this step, or failed/withdrawn (RPC thread) meanwhile
            taken = sender.take_released()
            with self._lock:
                self._released.update(taken)
        with self._lock:
            released, self._released = self._released, set()
        return released or None

    def shutdown(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.shutdown()


__all__ = ["KVBridgeConnectorWorker", "StepEvents"]
