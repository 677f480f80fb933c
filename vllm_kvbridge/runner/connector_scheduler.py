"""``KVBridgeConnectorScheduler``: the scheduler side of ``KVBridgeConnector``.

One per engine, in the engine-core process. It decides *what* to send *when*, from the
:class:`RunnerSettings` trigger:

- ``on_finish``: in ``request_finished`` it returns ``delay_free_blocks=True`` and queues a
  :class:`KVSendSpec` for the next step (``num_tokens`` = tokens whose KV is computed:
  prompt + generated - 1).
- ``prefill_finished``: in ``build_connector_meta`` of the step that computes the last
  prompt token; the gather runs after that step's forward (``wait_for_save``), while the
  request still holds its blocks. ``stop_after_transfer`` caps the request at one token.
- ``special_token``: once the request has sampled ``trigger_token_id``; it sends the KV of
  every token *before* the trigger token (also when the token ends the request).

For a payload stage it also announces each capturing request and ships its accepted output
tokens in every step's metadata (``capture``; :mod:`vllm_kvbridge.runner.capture` pairs them
with the rows the runner captured), the last ones with the request's end. For a stage fed
per step it holds the feeds (:mod:`vllm_kvbridge.runner.conditioning`) that
:mod:`vllm_kvbridge.runner.conditioning_scheduler` gates requests on.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_kvbridge.errors import ConfigError
from vllm_kvbridge.kv.layout_vllm import KVCacheGroup, kv_cache_groups
from vllm_kvbridge.runner import progress
from vllm_kvbridge.runner.capture import CaptureUpdate, CapturingRequest
from vllm_kvbridge.runner.conditioning import CONDITION_OPTION
from vllm_kvbridge.runner.settings import KVSendSettings, RunnerSettings
from vllm_kvbridge.runner.transfer_status import failed
from vllm_kvbridge.runner.vllm_connector import (
    KVBridgeConnectorMetadata,
    KVSendSpec,
    request_options,
    transfer_id_for,
)

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from vllm_kvbridge.runner.conditioning import ConditioningFeeds

logger = logging.getLogger(__name__)

#: Longest the scheduler-side shutdown waits for a worker the executor killed to be gone
#: before it reaps the stage's leftovers (the client SIGKILLs an engine core after 5 s).
WORKER_TEARDOWN_WAIT_S = 1.0


#: One send's block tables (one per KV cache group, from token 0) and each group's first token.
_Tables = tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]

#: vLLM's null block: what a table lists where its blocks went back (``BlockPool.null_block``).
NULL_BLOCK_ID = 0


@dataclass
class _Tracked:
    request: Request
    transfer_id: str
    kv_send: KVSendSettings
    sent: bool = False
    scan_pos: int = 0
    purpose: str = "kv"
    companion_of: str | None = None

    def spec(self, tables: _Tables, num_tokens: int, release: bool) -> KVSendSpec:
        block_ids, starts = tables
        return KVSendSpec(
            self.request.request_id,
            self.transfer_id,
            block_ids,
            num_tokens,
            release,
            starts,
            self.purpose,
            self.companion_of,
        )


class KVBridgeConnectorScheduler:
    """Send triggers, held blocks, capture updates and feeds of one engine (see the module
    docstring)."""

    def __init__(
        self, settings: RunnerSettings, vllm_config: Any, block_size: int, kv_cache_config: Any = None
    ) -> None:
        self.settings = settings
        self.block_size = block_size
        #: vLLM's KV cache groups (one without a config: the non-hybrid path's single table)
        self.groups: tuple[KVCacheGroup, ...] = (KVCacheGroup(()),)
        if kv_cache_config is not None and settings.sends_kv:
            self.groups = kv_cache_groups(kv_cache_config)
        self._kv_cache_manager: Any = None
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[KVSendSpec] = []
        self._finished: dict[str, tuple[str, str]] = {}
        #: requests whose blocks are held until the workers report them in finished_sending
        self.held: set[str] = set()
        #: per-step conditioning of a fed stage (runner/conditioning.py)
        self._feeds: ConditioningFeeds | None = None
        self._fed: dict[str, Request] = {}
        self._feed_errors: dict[str, str] = {}
        self._feed_dim: int | None = None
        self._capturing: dict[str, CapturingRequest] = {}
        #: last updates of requests that ended, for the next step's metadata
        self._capture_tail: dict[str, CaptureUpdate] = {}
        if settings.payload.per_step_inputs:
            from vllm_kvbridge.runner.conditioning import ConditioningFeeds

            self._feeds = ConditioningFeeds(settings.stage_id, settings.payload.per_step_inputs)
            dim = getattr(vllm_config.model_config.hf_config, "kvbridge_conditioning_dim", None)
            self._feed_dim = int(dim) if dim else None

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kv_cache_manager = kv_cache_manager

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
            # vLLM drops the connector's "ask again later" (get_num_new_matched_tokens ->
            # None) for a request that skips reading the prefix cache, so such a fed
            # request would start, or resume after a preemption, before its rows arrived
            # and run those positions on zeros. The pipeline sets the flag on every
            # request of a stage that sends payloads (a talker that streams its codes:
            # issue 40). A fed stage runs without prefix caching (worker.engine_kwargs),
            # so the flag has nothing else to do here.
            request.skip_reading_prefix_cache = False
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

    def _tables(self, block_ids: tuple[list[int], ...] | Any, num_tokens: int) -> _Tables | None:
        """Each group's table up to ``num_tokens`` and its first kept token; None when a block
        a group must send went back already (a sliding window that moved past a trigger's
        tokens, or blocks a preempted request has not recomputed)."""
        if len(block_ids) != len(self.groups):
            raise RuntimeError(f"{len(block_ids)} block tables for {len(self.groups)} KV cache groups")
        n = math.ceil(num_tokens / self.block_size)
        tables, starts = [], []
        for group, ids in zip(self.groups, block_ids, strict=True):
            start = group.first_kept(num_tokens)
            table = tuple(ids[:n])
            needed = table[start // self.block_size :]
            if len(table) < n or NULL_BLOCK_ID in needed:
                return None
            tables.append(table)
            starts.append(start)
        return tuple(tables), tuple(starts)

    def _blocks_for(self, req_id: str, num_tokens: int) -> _Tables | None:
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return self._tables(self._kv_cache_manager.get_block_ids(req_id), num_tokens)

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
                tables = self._blocks_for(req_id, n)
                computed = req.num_computed_tokens + scheduled.get(req_id, 0)
                if computed < n or tables is None:
                    continue
                sends.append(tracked.spec(tables, n, False))
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

    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished_all_groups``: ``block_ids`` has one table per KV cache
        group (one table where vLLM's hybrid allocator is off)."""
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
        tables = self._tables(block_ids, num_tokens)
        if tables is None:  # a sliding window moved past the trigger's tokens: they are gone
            return False, {
                "kvbridge_transfer_id": transfer_id,
                "kvbridge_kv": failed(
                    f"the KV of its first {num_tokens} tokens is no longer held (a sliding-window "
                    "layer's window moved past them)"
                ),
            }
        self._pending.append(tracked.spec(tables, num_tokens, True))
        self.held.add(req_id)
        return True, {"kvbridge_transfer_id": transfer_id, "kvbridge_kv": "submitted"}

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in connector_output.finished_sending or ():
            self.held.discard(req_id)

    def has_pending_block_frees(self) -> bool:
        return bool(self.held)

    def shutdown(self) -> None:
        """In the engine-core process, after the executor stopped the workers: remove what a
        worker that was killed before it finished shutting down left on this stage's
        shared-memory edges (only names of dead processes are touched)."""
        from vllm_kvbridge.runner.stage_runtime import reap_stage_leftovers

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


__all__ = ["WORKER_TEARDOWN_WAIT_S", "KVBridgeConnectorScheduler"]
