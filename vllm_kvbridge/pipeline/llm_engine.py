"""The engine of an LLM stage: a vLLM ``LLMEngine`` running the kvbridge worker.

The stage's runner settings travel to the worker as ``additional_config["kvbridge"]``
(:func:`vllm_kvbridge.runner.worker.engine_kwargs`). Requests are added to vLLM's engine
and stepped by the serve loop, so new requests join a running batch. A finished request
is reported only once its KV/payload sends settled, together with the sender info of
every rank, which the orchestrator forwards to the next stage: the workers push each
transfer's outcome to the stage (:mod:`vllm_kvbridge.runner.outcomes`), and
:class:`~vllm_kvbridge.pipeline.awaited_sends.AwaitedSends` judges each request. The
transfer id of every request is the orchestrator's request id (``extra_args["kvbridge"]["request_id"]``).

A stage with an incoming payload edge (a talker) takes the producer's payload one of two
ways (the edge's ``feed``):

* ``prompt_embeds``: it receives the whole payload on a
  :class:`~vllm_kvbridge.runner.payload_receiver.PayloadReceiver` and then submits its
  ``hidden_states`` to vLLM as prompt embeddings (``enable_prompt_embeds``);
* ``per_step``: it adds the request to vLLM at once, with the model's start token as its
  prompt and the stream named in ``extra_args["kvbridge"]["condition"]``; the engine's
  connector receives the rows and its scheduler runs each position once its row is there
  (:mod:`vllm_kvbridge.runner.conditioning`), so the talker overlaps the thinker. A stream
  that fails fails the request with the reason (``kvbridge_error``).

Every ``StageDone`` carries ``first_token_at`` / ``last_token_at`` (``time.time()`` when
the engine produced the request's first and last token), which ``run`` writes to
result.json.

A request submitted with ``stream`` gets a :class:`~vllm_kvbridge.pipeline.messages.StageProgress`
after every engine step that produced new text or tokens (vLLM's outputs are cumulative:
the delta is what was not sent yet); other requests cost nothing extra.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec

from vllm_kvbridge.config.cpu_kv_cache import with_cpu_kv_cache
from vllm_kvbridge.config.resolve import ResolvedStage
from vllm_kvbridge.config.runner_settings import runner_settings
from vllm_kvbridge.errors import RequestRejected
from vllm_kvbridge.models.builtin import builtin_model
from vllm_kvbridge.pipeline import messages as m
from vllm_kvbridge.pipeline.awaited_sends import AwaitedSends
from vllm_kvbridge.pipeline.cfg import CompanionGroups
from vllm_kvbridge.pipeline.engines import ExpiringIds, StageEngine, Waker, producer_lost_failure
from vllm_kvbridge.pipeline.sender_info import kv_send_owed, kv_send_refused, payload_meta
from vllm_kvbridge.runner.conditioning import CONDITION_OPTION
from vllm_kvbridge.runner.conditioning_scheduler import ERROR_KEY
from vllm_kvbridge.runner.outcomes import OUTCOMES_ENV, OutcomeInbox
from vllm_kvbridge.runner.settings import RunnerSettings

#: Longest a step waits for a worker's outcome when nothing else is to be done (the serve
#: loop then takes new requests; an outcome's arrival ends the wait at once).
SETTLE_WAIT_S = 0.005


def with_platform_kv_cache(
    model: str, kwargs: dict[str, Any], tensor_parallel_size: int = 1
) -> dict[str, Any]:
    """``kwargs`` with a KV cache size on CPU where the user set none
    (:func:`~vllm_kvbridge.config.cpu_kv_cache.with_cpu_kv_cache`); as they are on GPU,
    where vLLM sizes the cache from the device's free memory."""
    from vllm.platforms import current_platform

    return with_cpu_kv_cache(model, kwargs, tensor_parallel_size) if current_platform.is_cpu() else kwargs


class LLMStageEngine(StageEngine):
    def __init__(self, stage: ResolvedStage) -> None:
        super().__init__(stage)
        from vllm import LLM

        from vllm_kvbridge.runner.worker import engine_kwargs

        self.settings = runner_settings(stage)
        self.moves_data = bool(stage.outputs or stage.inputs)
        kwargs = dict(stage.engine_args)
        if self.moves_data or stage.runner_cls:
            kwargs.update(
                engine_kwargs(
                    self.settings,
                    worker_cls=stage.worker_cls,
                    async_scheduling=stage.engine_args.get("async_scheduling"),
                )
            )
        model = builtin_model(stage.model)
        kwargs = with_platform_kv_cache(model, kwargs, stage.tensor_parallel_size)
        #: the workers' outcomes of this stage's sends (a stage that sends anything)
        self._sends: AwaitedSends | None = None
        inbox = OutcomeInbox() if self.moves_data and stage.outputs else None
        try:
            if inbox is not None:
                os.environ[OUTCOMES_ENV] = inbox.address  # vLLM's processes inherit it
            self.llm = LLM(model=model, tensor_parallel_size=stage.tensor_parallel_size, **kwargs)
        except BaseException:
            if inbox is not None:
                inbox.close()
            raise
        finally:
            os.environ.pop(OUTCOMES_ENV, None)
        self.engine = self.llm.llm_engine
        if inbox is not None:
            self._sends = AwaitedSends(inbox, self.engine.vllm_config.parallel_config.world_size)
        #: whether this stage's payload edges capture every request (unless it opts out)
        payload_settings = RunnerSettings.from_dict(self.settings).payload
        self._captures = payload_settings.captures
        self._no_capture: set[str] = set()
        self.dump_dir = Path(stage.debug_dump_dir) if stage.debug_dump_dir else None
        self._receivers: dict[int, Any] = {}
        self._pool: ThreadPoolExecutor | None = None
        feeds = {str(e.peer_stage): e.feed for e in payload_settings.inputs}
        #: producers whose rows condition the model per step (no receiver here: the engine's)
        self._fed_from = {e.from_stage for e in stage.inputs if feeds.get(str(e.from_stage)) == "per_step"}
        for e in stage.inputs:
            if e.payload_mode == "none" or e.from_stage in self._fed_from:
                continue
            from vllm_kvbridge.connectors.registry import create_connector
            from vllm_kvbridge.runner.payload_receiver import PayloadReceiver

            self._receivers[e.from_stage] = PayloadReceiver(
                create_connector(e.connector.name, e.connector.config),
                e.from_stage,
                stage.stage_id,
                mode=e.payload_mode,
                recv_timeout_s=float(stage.payload.get("recv_timeout", 30.0)),
                stall_timeout_s=float(stage.payload.get("stall_timeout", 30.0)),
                close_connector=True,
            )
        #: rung when a payload wait completes: the serve loop sleeps until then (not spinning)
        self._waker: Waker | None = None
        if self._receivers:
            self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvbridge-payload-wait")
            self._waker = Waker()
        #: request id -> time.time() of its first token (popped when it is reported)
        self._first_token: dict[str, float] = {}
        self._inputs: dict[str, tuple[Future, Any]] = {}  # rid -> (payload wait, sampling params)
        #: request id -> (payload bytes, ReceiveTiming) of its received payload, until reported
        self._recv_stats: dict[str, tuple[int, Any]] = {}
        self._input_of: dict[str, tuple[int, str]] = {}  # rid -> (producer, transfer id)
        self._started: dict[str, float] = {}
        self._awaiting: dict[str, Any] = {}  # finished in vLLM, sends still in flight
        self._aborted = ExpiringIds()
        #: streaming request id -> (characters, tokens) already reported in StageProgress
        self._streamed: dict[str, tuple[int, int]] = {}
        #: CFG companions of requests (see pipeline/cfg.py); only a stage that sends KV runs them
        self._cfg = CompanionGroups()
        #: whether this stage sends KV (aborted and failed requests' KV is withdrawn)
        kv_transfer = self.settings.get("kv_transfer") or {}
        self._sends_kv = bool(self.moves_data and self.stage.outputs and kv_transfer.get("need_send_cache"))

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"kind": self.stage.kind, "model": self.stage.model, "pid_engine": None}
        if any(e.payload_mode == "async_chunk" for e in self.stage.outputs):
            # Async-chunk consumers start before any chunk is put: they reach the payload
            # senders with what those can say up front (e.g. a ZMQ endpoint).
            payload = payload_meta(self.llm.collective_rpc("kvbridge_sender_info"))
            info["sender_info"] = {"payload": payload} if payload else {}
        return info

    # -- requests --------------------------------------------------------------------------
    def _params(self, msg: m.Submit) -> Any:
        from vllm import SamplingParams

        params = {**self.stage.default_sampling_params, **msg.sampling_params}
        params.pop("num_steps", None)
        extra = dict(params.pop("extra_args", None) or {})
        extra["kvbridge"] = {**(extra.get("kvbridge") or {}), "request_id": msg.request_id}
        if extra["kvbridge"].get("capture") is False:
            self._no_capture.add(msg.request_id)  # no payload owed (runner/step_capture.py)
        if any(e.payload_mode != "none" for e in self.stage.outputs):
            # Captured hidden states must cover the whole prompt: rows from the prefix cache
            # are never computed (the runner fails such a request rather than send it short).
            params.setdefault("skip_reading_prefix_cache", True)
        return SamplingParams(**params, extra_args=extra)

    def _companion_params(self, msg: m.Submit, companion_id: str, purpose: str) -> Any:
        """Prefill only: the companion's KV is exactly its prompt's, sent under the primary's
        id with ``purpose`` in the key (status and sender info are filed under its own id)."""
        from vllm import SamplingParams

        params = {**self.stage.default_sampling_params, **msg.sampling_params}
        for name in ("num_steps", "extra_args", "max_tokens", "min_tokens", "stop", "stop_token_ids"):
            params.pop(name, None)
        extra = {
            "request_id": companion_id,
            "purpose": purpose,
            "companion_of": msg.request_id,
            "trigger": "prefill_finished",
            "stop_after_transfer": True,
        }
        return SamplingParams(**params, max_tokens=1, extra_args={"kvbridge": extra})

    def _submit_companions(self, msg: m.Submit) -> None:
        if msg.prompt is None:
            raise ValueError(f"request {msg.request_id!r}: CFG companions need a text prompt")
        ids = self._cfg.add(msg.request_id, msg.companions)
        for cid, prompt in ids.items():
            _, purpose = self._cfg.owner(cid) or ("", "")
            self.engine.add_request(cid, prompt, self._companion_params(msg, cid, purpose))

    def submit(self, msg: m.Submit) -> None:
        """Start ``msg``'s request; :class:`RequestRejected` when vLLM refuses its input."""
        from vllm.exceptions import VLLMClientError

        try:
            self._submit(msg)
        except (VLLMClientError, ValueError, TypeError) as exc:
            # The request's own fault (validation, bad sampling parameters): forget it (and
            # its CFG companions) here, fail it alone; the stage keeps serving.
            self.abort([msg.request_id])
            self._started.pop(msg.request_id, None)
            self._aborted.discard(msg.request_id)
            raise RequestRejected(f"{type(exc).__name__}: {exc}") from exc

    def _submit(self, msg: m.Submit) -> None:
        if msg.routes:  # before the request (and its companions) can put anything
            routes = {str(b): r for b, r in msg.routes.items()}
            self.llm.collective_rpc("kvbridge_route", args=(msg.request_id, routes))
        if msg.companions and (self.settings.get("kv_transfer") or {}).get("need_send_cache"):
            self._submit_companions(msg)
        params = self._params(msg)
        self._started[msg.request_id] = time.time()
        if msg.stream:
            self._streamed[msg.request_id] = (0, 0)
        fed = [u for u in msg.upstream if u.from_stage in self._fed_from]
        if fed:
            self._submit_fed(msg, fed[0], params)
            return
        payload_ups = [u for u in msg.upstream if u.from_stage in self._receivers]
        if payload_ups:
            up = payload_ups[0]
            receiver = self._receivers[up.from_stage]
            meta = (up.sender_info.get("payload") or {}).get(str(self.stage.stage_id)) or None
            receiver.expect(up.transfer_request_id, metadata=meta)
            assert self._pool is not None and self._waker is not None
            fut = self._pool.submit(receiver.result_timed, up.transfer_request_id)
            fut.add_done_callback(lambda _: self._waker.ring())
            self._inputs[msg.request_id] = (fut, params)
            self._input_of[msg.request_id] = (up.from_stage, up.transfer_request_id)
            return
        if msg.prompt is None:
            raise ValueError(f"request {msg.request_id!r} has neither a prompt nor an upstream payload")
        self.engine.add_request(msg.request_id, msg.prompt, params)

    def _submit_fed(self, msg: m.Submit, up: m.Upstream, params: Any) -> None:
        """Start a request whose model is conditioned per step on ``up``'s stream: at once,
        from the model's start token (see the module docstring)."""
        start = self.engine.model_config.hf_config.bos_token_id
        if start is None:
            raise ValueError(
                f"stage {self.stage.stage_id}: a per_step feed starts from the model's bos_token_id"
            )
        meta = (up.sender_info.get("payload") or {}).get(str(self.stage.stage_id)) or None
        params.extra_args["kvbridge"][CONDITION_OPTION] = {
            "from_stage": up.from_stage,
            "transfer_id": up.transfer_request_id,
            "metadata": meta,
        }
        self.engine.add_request(msg.request_id, {"prompt_token_ids": [int(start)]}, params)

    def abort(self, request_ids: list[str]) -> None:
        request_ids = list(request_ids)
        for rid in list(request_ids):
            request_ids.extend(i for i in self._cfg.fail(rid) if i != rid)
        for rid in request_ids:
            self._aborted.add(rid)
            entry = self._inputs.pop(rid, None)
            self._input_of.pop(rid, None)
            if entry is not None:
                for receiver in self._receivers.values():
                    receiver.cancel(rid)
            self._awaiting.pop(rid, None)
            self._streamed.pop(rid, None)
            self._first_token.pop(rid, None)
            self._recv_stats.pop(rid, None)
        self.engine.abort_request(list(request_ids))
        # Nobody downstream will consume their KV, whether it is out already (sent, maybe
        # reported in a StageDone this Abort crossed), being sent, or owed by a request
        # that finished in the engine core before the abort reached it.
        self._withdraw_kv(request_ids)

    def producer_lost(self, msg: m.ProducerLost) -> list[m.RequestFailed]:
        receiver = self._receivers.get(msg.stage_id)
        if receiver is None or getattr(receiver.connector, "data_outlives_sender", True):
            return []  # no payload from it, or one that is still readable
        out = []
        for rid in msg.request_ids:
            src = self._input_of.get(rid)
            # Not in _inputs: its payload was read and it runs in vLLM (nothing to give up).
            if (
                rid in self._inputs
                and src is not None
                and src[0] == msg.stage_id
                and receiver.withdraw(src[1])
            ):
                del self._inputs[rid], self._input_of[rid]
                self._streamed.pop(rid, None)
                out.append(producer_lost_failure(msg, rid, self.stage, "payload"))
        return out

    def _withdraw_kv(self, request_ids: list[str]) -> None:
        """Withdraw the KV of ``request_ids`` on every rank: what is out now at once, a send
        in flight or still to start when it completes (``kvbridge_discard_kv``)."""
        if self._sends_kv and request_ids:
            self.llm.collective_rpc("kvbridge_discard_kv", args=(list(request_ids),))

    def edge_counters(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for rank in self.llm.collective_rpc("kvbridge_edge_counters"):
            for name, value in rank.items():
                total[name] = total.get(name, 0.0) + value
        return total

    def waker(self) -> Waker | None:
        return self._waker

    def busy(self) -> bool:
        # A payload still on its way is no work: counting it made the serve loop spin (a
        # core taken from the producer for as long as it generated; its arrival rings the
        # waker instead).
        return (
            bool(self._awaiting)
            or any(fut.done() for fut, _ in self._inputs.values())
            or self.engine.has_unfinished_requests()
        )

    # -- progress --------------------------------------------------------------------------
    def _start_from_payload(self, out: list[m.StageDone | m.StageProgress | m.RequestFailed]) -> None:
        for rid, (fut, params) in list(self._inputs.items()):
            if not fut.done():
                continue
            del self._inputs[rid]
            self._input_of.pop(rid, None)
            try:
                payload, timing = fut.result()
                embeds = payload["hidden_states"]
                if self.dump_dir is not None:
                    self._dump(rid, payload)
                self.engine.add_request(rid, {"prompt_embeds": embeds}, params)
                self._recv_stats[rid] = (int(embeds.numel() * embeds.element_size()), timing)
            except Exception as exc:
                self._streamed.pop(rid, None)
                out.append(m.RequestFailed(rid, self.stage.stage_id, f"{type(exc).__name__}: {exc}"))

    def _dump(self, rid: str, payload: dict[str, Any]) -> None:
        import torch
        from safetensors.torch import save_file

        from vllm_kvbridge.connectors.keys import encode_request_id

        assert self.dump_dir is not None
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        tensors = {
            k: v.detach().cpu().contiguous().clone()
            for k, v in payload.items()
            if isinstance(v, torch.Tensor)
        }
        save_file(
            tensors,
            str(self.dump_dir / f"stage{self.stage.stage_id}_{encode_request_id(rid)}_payload.safetensors"),
        )

    def step(self) -> list[m.StageDone | m.StageProgress | m.RequestFailed]:
        out: list[m.StageDone | m.StageProgress | m.RequestFailed] = []
        if self._inputs:
            self._start_from_payload(out)
        if self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            # Taken after the step: it blocks until the engine core has output, which for a
            # request fed per step can be long after the step was asked for.
            now = time.time()
            for o in outputs:
                if o.request_id in self._aborted:
                    continue
                error = (o.kv_transfer_params or {}).get(ERROR_KEY) if o.finished else None
                if error:  # its per-step feed failed in the engine (runner/conditioning.py)
                    self._forget(o.request_id)
                    out.append(m.RequestFailed(o.request_id, self.stage.stage_id, str(error)))
                    continue
                if o.outputs and o.outputs[0].token_ids:
                    self._first_token.setdefault(o.request_id, now)
                if o.request_id in self._streamed:
                    self._progress(o, out)
                if o.finished:
                    self._awaiting[o.request_id] = (o, now)
        if self._awaiting:
            self._report_finished(out)
        return out

    def _forget(self, rid: str) -> None:
        for table in (self._started, self._streamed, self._first_token, self._recv_stats):
            table.pop(rid, None)
        self._no_capture.discard(rid)
        if self._sends is not None:
            self._sends.forget(rid)

    def _progress(self, o: Any, out: list[m.StageDone | m.StageProgress | m.RequestFailed]) -> None:
        """Append a StageProgress with what ``o`` (a cumulative output) adds to what was sent."""
        comp = o.outputs[0]
        sent_chars, sent_tokens = self._streamed[o.request_id]
        text, ids = comp.text, comp.token_ids
        if o.finished:
            del self._streamed[o.request_id]
        else:
            self._streamed[o.request_id] = (len(text), len(ids))
        if len(text) > sent_chars or len(ids) > sent_tokens:
            out.append(
                m.StageProgress(o.request_id, self.stage.stage_id, text[sent_chars:], list(ids[sent_tokens:]))
            )

    def _report_finished(self, out: list[m.StageDone | m.StageProgress | m.RequestFailed]) -> None:
        ready: dict[str, dict[str, Any]] = {rid: {} for rid in self._awaiting}
        sends = self._sends
        if sends is not None:
            sends.take()
            ready = {}
            for rid, (o, finished_at) in list(self._awaiting.items()):
                if rid not in self._awaiting:
                    continue  # its CFG group failed while this loop ran
                refused = kv_send_refused(o)
                if refused is not None:
                    self._awaiting.pop(rid, None)
                    self._fail_group(rid, f"transfer failed: {refused}", out)
                    continue
                verdict = sends.verdict(
                    rid,
                    kv_owed=kv_send_owed(o),
                    payload_owed=self._captures and rid not in self._no_capture,
                    must_send_kv=self._cfg.owner(rid) is not None,
                    finished_at=finished_at,
                )
                if verdict.state == "failed":
                    self._awaiting.pop(rid, None)
                    self._fail_group(rid, f"transfer failed: {verdict.error}", out)
                elif verdict.state == "ready":
                    ready[rid] = verdict.sender_info
            if not ready and not self.engine.has_unfinished_requests():
                # Nothing else to do: sleep until a worker's outcome arrives (bounded, so the
                # serve loop still takes new requests).
                sends.take(SETTLE_WAIT_S)
                return
        for rid, sender_info in ready.items():
            if rid not in self._awaiting:
                continue  # its group failed while its status was read
            o, finished_at = self._awaiting.pop(rid)
            self._no_capture.discard(rid)
            if sends is not None:
                sends.forget(rid)
            if self._cfg.owner(rid) is not None:  # a CFG companion: its primary reports it
                primary = self._cfg.owner(rid)[0]
                self._cfg.companion_done(rid, sender_info)
                self._emit_group(primary, out)
                continue
            comp = o.outputs[0]
            transfers = []
            stats = self._recv_stats.pop(rid, None)
            if stats is not None:
                up = next(e.from_stage for e in self.stage.inputs if e.payload_mode != "none")
                nbytes, timing = stats
                transfers.append(
                    m.TransferStat(
                        up,
                        self.stage.stage_id,
                        "payload",
                        nbytes,
                        timing.get_s,
                        "receiver",
                        waited_s=timing.waited_s,
                        ready_at=timing.ready_at,
                    )
                )
            done = m.StageDone(
                rid,
                self.stage.stage_id,
                output={
                    "text": comp.text,
                    "token_ids": list(comp.token_ids),
                    "prompt_token_ids": list(o.prompt_token_ids or []),
                },
                transfer_request_id=rid,
                sender_info=sender_info,
                started=self._started.pop(rid, finished_at),
                finished=time.time(),
                transfers=transfers,
                first_token_at=self._first_token.pop(rid, finished_at),
                last_token_at=finished_at,
            )
            if self._cfg.has(rid):
                self._cfg.primary_done(rid, done)
                self._emit_group(rid, out)
            else:
                out.append(done)

    def _emit_group(self, primary: str, out: list[m.StageDone | m.StageProgress | m.RequestFailed]) -> None:
        """Report ``primary`` once it and all its CFG companions were sent: one StageDone whose
        sender info holds every key (the companions' keys name their purpose)."""
        got = self._cfg.complete(primary)
        if got is None:
            return
        done, infos = got
        keys = dict(done.sender_info.get("keys") or {})
        ranks = dict(done.sender_info.get("ranks") or {})
        for info in infos:
            keys.update(info.get("keys") or {})
            for r, meta in (info.get("ranks") or {}).items():
                ranks.setdefault(r, meta)
        info = dict(done.sender_info)
        if keys:
            info["keys"] = keys
        if ranks:
            info["ranks"] = ranks
        out.append(msgspec.structs.replace(done, sender_info=info))

    def _fail_group(
        self, rid: str, error: str, out: list[m.StageDone | m.StageProgress | m.RequestFailed]
    ) -> None:
        """Fail ``rid``'s request; a companion's failure fails its primary, naming it. The
        rest of the group is aborted at once (no member waits for its own timeout)."""
        owner = self._cfg.owner(rid)
        primary = owner[0] if owner else rid
        members = self._cfg.fail(rid)
        if owner is not None:
            error = f"CFG companion {owner[1]!r} ({rid}) of {primary}: {error}"
        others = [i for i in members if i != rid]
        for i in others:
            self._awaiting.pop(i, None)
        if others:
            self._aborted.update(others)
            self.engine.abort_request(others)
            self._withdraw_kv(others)  # e.g. the primary's KV, sent before its companion failed
        self._forget(primary)
        out.append(m.RequestFailed(primary, self.stage.stage_id, error))

    def close(self) -> None:
        for receiver in self._receivers.values():
            receiver.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._waker is not None:
            self._waker.close()
        if self._sends is not None:
            self._sends.inbox.close()
        try:
            self.engine.engine_core.shutdown()
        except Exception:
            pass
