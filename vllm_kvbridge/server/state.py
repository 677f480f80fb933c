"""The state behind ``vllm-kvbridge serve``'s handlers: the pipeline service, what the
pipeline makes, request admission, running (and streaming) one request with client
disconnects and the shutdown drain, and the mapping of a request's failure to its HTTP
status (the error contract in :mod:`vllm_kvbridge.server.app`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import Request

from vllm_kvbridge.pipeline.messages import StageProgress
from vllm_kvbridge.pipeline.orchestrator import PipelineError, RequestResult, StageRecovering
from vllm_kvbridge.pipeline.service import Overloaded, PipelineService
from vllm_kvbridge.server.auth import SCOPE_KEY
from vllm_kvbridge.server.errors import ApiError, ClientGone
from vllm_kvbridge.server.metrics import ServerMetrics
from vllm_kvbridge.server.protocol import ChatCompletionRequest

#: How often a waiting handler checks whether its client is still connected (seconds).
DISCONNECT_POLL_S = 0.1
#: ``Retry-After`` (seconds) of a 429 answer (``max_in_flight`` requests in flight).
RETRY_AFTER_S = "1"
#: ``Retry-After`` (seconds) of a 503 answer while a lost stage is restarted.
RECOVERING_RETRY_AFTER_S = "5"
#: What a pipeline's last stage makes, by its kind (LLM stages: text), and where to ask for it.
OUTPUT_OF_KIND = {"diffusion": "image", "vocoder": "audio"}
ENDPOINT_OF_OUTPUT = {
    "image": "/v1/images/generations",
    "audio": "/v1/audio/speech",
    "text": "/v1/completions or /v1/chat/completions",
}


class ServerState:
    """What the handlers share: the pipeline service, the model's tokenizer and limits."""

    def __init__(
        self,
        service: PipelineService,
        *,
        served_model_name: str,
        tokenizer: Any = None,
        output_dir: str | Path | None = None,
        drain_s: float = 10.0,
    ) -> None:
        self.service = service
        self.plan = service.pipeline.plan
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.drain_s = drain_s
        #: ``time.monotonic()`` by which a request still running at shutdown is aborted (503)
        self._drain_deadline: float | None = None
        self.output_dir = Path(output_dir) if output_dir else None
        entry = self.plan.entry_stage
        self.max_model_len = int(entry.engine_args.get("max_model_len") or 0) or None
        self.default_max_tokens = int(entry.default_sampling_params.get("max_tokens") or 16)
        #: what the last stage makes: "image" (diffusion), "audio" (vocoder) or "text"
        self.output_kind = OUTPUT_OF_KIND.get(self.plan.final_stage.kind, "text")
        self.metrics = ServerMetrics(
            lambda: float(service.in_flight()),
            service.pipeline.stage_health,
            service.pipeline.control_counters,
        )
        service.on_result = self.metrics.observe_result
        self.created = int(time.time())
        #: requests handed to the service so far (``/debug/state``: a refused one adds none)
        self.submitted = 0

    # -- validation --------------------------------------------------------------------
    def require_output(self, kind: str) -> None:
        """400 unless this pipeline makes ``kind`` (the error names the endpoint to use)."""
        if self.output_kind != kind:
            raise ApiError(
                400,
                f"this pipeline produces {'images' if self.output_kind == 'image' else self.output_kind}: "
                f"use {ENDPOINT_OF_OUTPUT[self.output_kind]}",
            )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist (this server serves `{self.served_model_name}`)",
                "NotFoundError",
                "model_not_found",
            )

    async def check_length(self, prompt: str, max_tokens: int | None, param: str = "prompt") -> None:
        """400 when ``prompt`` (the request field ``param``) and ``max_tokens`` do not fit the
        first stage's context. Tokenized off the event loop: a long prompt takes seconds,
        which would stall every other request and ``/health`` meanwhile."""
        if self.tokenizer is None or self.max_model_len is None:
            return
        n = await asyncio.to_thread(self._count_tokens, prompt)
        want = max_tokens or self.default_max_tokens
        if n + want > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + want} tokens ({n} in the {param}, {want} for the completion). "
                f"Please reduce the length of the {param} or max_tokens.",
                reason="bad_request",
                param=param,
            )

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text).input_ids)

    async def chat_prompt(self, req: ChatCompletionRequest) -> str:
        """The chat's prompt: the model's chat template (rendered off the event loop, as it
        runs over the whole transcript) or, without one, a plain transcript."""
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        tok = self.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            return str(
                await asyncio.to_thread(
                    tok.apply_chat_template, messages, tokenize=False, add_generation_prompt=True
                )
            )
        # No chat template (e.g. the tiny offline model): a plain transcript.
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def begin_shutdown(self) -> None:
        """The server is stopping: requests still running ``drain_s`` from now are aborted
        and answered 503 (before the HTTP server gives up on them, which would be a 500)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.drain_s

    def _drained_out(self) -> bool:
        return self._drain_deadline is not None and time.monotonic() >= self._drain_deadline

    # -- running a request --------------------------------------------------------------
    async def run(
        self,
        request: Request,
        prompt: str,
        params: dict[str, Any],
        stage_params: dict[int, dict[str, Any]] | None = None,
        prefix: str = "req",
    ) -> RequestResult:
        """Run one request; the :class:`ApiError` of the error contract when it fails."""
        [result] = await self.run_many(request, [(prompt, params, stage_params)], prefix=prefix)
        return result

    async def run_many(
        self,
        request: Request,
        jobs: list[tuple[str, dict[str, Any], dict[int, dict[str, Any]] | None]],
        prefix: str = "req",
    ) -> list[RequestResult]:
        """Run the requests ``jobs`` (prompt, sampling params, stage params) of one HTTP
        request together, admitted or refused as a whole: none is started unless all fit
        under ``max_in_flight`` (429 otherwise). The first one to fail aborts the others."""
        svc = self.service
        self._check_up()
        self._admit(len(jobs))
        # Every handler submits on this event loop thread and nothing awaits between the
        # admission and the last submit, so no other request can take the room meanwhile.
        submitted: list[tuple[str, asyncio.Future[RequestResult]]] = []
        try:
            for prompt, params, stage_params in jobs:
                rid, fut = self._submit(prompt, params, stage_params=stage_params, prefix=prefix)
                submitted.append((rid, asyncio.wrap_future(fut)))
        except ApiError:  # a stage was lost between two submits: the request fails whole
            for rid, _ in submitted:
                svc.abort(rid, "refused: another part of its HTTP request was refused")
            raise
        waiting = dict(submitted)
        aborted = False
        try:
            while waiting:
                done, _ = await asyncio.wait(set(waiting.values()), timeout=DISCONNECT_POLL_S)
                for rid in [rid for rid, w in waiting.items() if w in done]:
                    self._checked(rid, waiting.pop(rid))  # raises the first failure
                if not waiting:
                    break
                if not aborted and self._drained_out():
                    for rid in waiting:
                        svc.abort(rid, "server shutting down")  # its result comes back as a 503
                    aborted = True
                if await request.is_disconnected():
                    for rid in waiting:
                        svc.abort(rid, "client disconnected")
                    self.metrics.failures.labels("client_disconnect").inc()
                    waiting.clear()
                    raise ClientGone()
        except asyncio.CancelledError:  # server shutdown cancelled the handler
            for rid in waiting:
                svc.abort(rid, "server shutting down")
            raise
        except ApiError:
            for rid in waiting:  # the answer is an error already: the rest would be wasted work
                svc.abort(rid, "another part of its HTTP request failed")
            raise
        return [self._checked(rid, w) for rid, w in submitted]

    async def stream(
        self, request: Request, prompt: str, params: dict[str, Any], prefix: str = "req"
    ) -> AsyncIterator[StageProgress | RequestResult]:
        """Like :meth:`run`, streaming: yields each :class:`StageProgress` of the last stage
        as it arrives, then the :class:`RequestResult` (raises :class:`ApiError` like
        :meth:`run`). A client that disconnects (noticed within ``DISCONNECT_POLL_S``) or a
        consumer that closes the generator early has the request aborted in every stage."""
        svc = self.service
        self._check_up()
        loop = asyncio.get_running_loop()
        # Progress (from the pump thread) and the finished future, in arrival order: the
        # orchestrator reports every progress message before it resolves the future.
        items: asyncio.Queue[StageProgress | asyncio.Future[RequestResult]] = asyncio.Queue()

        def on_progress(p: StageProgress) -> None:
            loop.call_soon_threadsafe(items.put_nowait, p)

        rid, fut = self._submit(prompt, params, prefix=prefix, on_progress=on_progress)
        waiter = asyncio.wrap_future(fut)
        waiter.add_done_callback(items.put_nowait)
        finished = False
        try:
            checked = loop.time()
            while True:
                try:
                    item = await asyncio.wait_for(items.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    item = None
                if isinstance(item, StageProgress):
                    yield item
                elif item is not None:
                    break
                if self._drained_out() and not waiter.done():
                    svc.abort(rid, "server shutting down")  # idempotent: the result says 503
                if loop.time() - checked >= DISCONNECT_POLL_S:
                    checked = loop.time()
                    if await request.is_disconnected():
                        svc.abort(rid, "client disconnected")
                        self.metrics.failures.labels("client_disconnect").inc()
                        finished = True
                        raise ClientGone()
            finished = True
        except asyncio.CancelledError:  # the client left, or server shutdown cancelled the handler
            finished = True
            if request.scope.get(SCOPE_KEY, {}).get("client_gone"):
                svc.abort(rid, "client disconnected")
                self.metrics.failures.labels("client_disconnect").inc()
            else:
                svc.abort(rid, "server shutting down")
            raise
        finally:
            if not finished:  # the consumer stopped reading (its client is gone)
                svc.abort(rid, "client disconnected")
                self.metrics.failures.labels("client_disconnect").inc()
        yield self._checked(rid, waiter)

    def _admit(self, n: int) -> None:
        """Refuse (429, or 503 while a stage recovers) ``n`` requests that do not all fit now."""
        svc = self.service
        lost = svc.pipeline.recovering()
        if lost and svc.failure is None:
            raise _recovering(StageRecovering(lost[0]))
        busy = svc.in_flight()
        if busy + n > svc.max_in_flight:
            what = f"{n} requests" if n > 1 else "a request"
            raise ApiError(
                429,
                f"server busy: {busy} requests in flight, {what} more would pass the limit "
                f"(max_in_flight {svc.max_in_flight})",
                "rate_limit_exceeded",
                "overloaded",
                {"Retry-After": RETRY_AFTER_S},
            )

    def _submit(self, prompt: str, params: dict[str, Any], **kwargs: Any) -> tuple[str, Any]:
        try:
            rid, fut = self.service.submit(prompt, params, **kwargs)
        except StageRecovering as exc:
            raise _recovering(exc) from None
        except Overloaded as exc:
            raise ApiError(
                429,
                f"server busy: {exc}",
                "rate_limit_exceeded",
                "overloaded",
                {"Retry-After": RETRY_AFTER_S},
            ) from None
        self.submitted += 1
        return rid, fut

    def _check_up(self) -> None:
        if self.service.failure is not None:
            raise ApiError(
                503, f"pipeline unavailable: {self.service.failure}", "service_unavailable", "stage_down"
            )

    def _checked(self, rid: str, waiter: asyncio.Future[RequestResult]) -> RequestResult:
        """The finished request's result, or the :class:`ApiError` its failure maps to."""
        svc = self.service
        try:
            result = waiter.result()
        except StageRecovering as exc:  # lost between the admission and the pump thread
            raise _recovering(exc) from None
        except PipelineError as exc:
            raise ApiError(503, f"pipeline unavailable: {exc}", "service_unavailable", "stage_down") from None
        if result.error:
            err = result.error
            if result.lost_stage is not None and svc.failure is None:
                # The stage it was in crashed or stalled; it is restarted (the next try may work).
                raise ApiError(502, f"request {rid} failed: {err}", "bad_gateway", "stage_lost")
            if err.startswith("timed out"):
                raise ApiError(504, f"request {rid} {err}", "timeout", "timeout")
            if "shutting down" in err:
                raise ApiError(503, f"request {rid}: {err}", "service_unavailable", "shutdown")
            if svc.failure is not None:
                raise ApiError(
                    503, f"pipeline unavailable: {svc.failure}", "service_unavailable", "stage_down"
                )
            raise ApiError(500, f"request {rid} failed: {err}", "internal_server_error", "stage_error")
        return result


def _recovering(exc: StageRecovering) -> ApiError:
    headers = {"Retry-After": RECOVERING_RETRY_AFTER_S}
    return ApiError(503, f"pipeline recovering: {exc}", "service_unavailable", "stage_recovering", headers)
