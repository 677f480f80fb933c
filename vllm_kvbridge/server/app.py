"""The FastAPI app of ``vllm-kvbridge serve`` (OpenAI-compatible where an endpoint fits).

Endpoints: ``POST /v1/images/generations`` (pipelines ending in a diffusion stage),
``POST /v1/completions`` and ``POST /v1/chat/completions`` (pipelines ending in an LLM
stage; ``stream: true`` answers as server-sent events, one chunk per piece of text the
last stage reports while it generates), ``POST /v1/audio/speech`` (pipelines ending in a
vocoder stage; :mod:`vllm_kvbridge.server.speech`), ``GET /v1/models``, ``GET /health``
(per stage; 503 when a stage is down), ``GET /metrics`` (Prometheus), ``GET /debug/state``
(in-flight requests and this run's shared-memory names), ``GET /images/{name}`` (images
returned as URLs).

Error contract (OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body):
400 bad JSON / schema / too-long prompt / wrong endpoint for this pipeline, 401 no valid
API key (with ``--api-key``), 404 unknown model, 429 ``max_in_flight`` requests are in
flight (with ``Retry-After``), 502 the stage the request was in crashed or stalled (it is
restarted: see ``pipeline/supervision.py``), 503 a stage is restarted meanwhile (with
``Retry-After``), is down for good, or the server is shutting down, 504 the request outlived
``runtime.request_timeout``, 500 a stage failed the request. A request never waits
longer than the pipeline's ``request_timeout``. A client that disconnects has its
request aborted in every stage (status 499 in the metrics).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from vllm_kvbridge.pipeline.messages import StageProgress
from vllm_kvbridge.pipeline.orchestrator import PipelineError, RequestResult, StageRecovering
from vllm_kvbridge.pipeline.service import Overloaded, PipelineService
from vllm_kvbridge.server.auth import DEFAULT_OPEN_PATHS, ApiKeyAuth
from vllm_kvbridge.server.errors import ApiError, ClientGone, error_body
from vllm_kvbridge.server.metrics import ServerMetrics
from vllm_kvbridge.server.protocol import ChatCompletionRequest, CompletionRequest, ImageRequest
from vllm_kvbridge.server.speech import add_speech_routes

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
_IMAGE_NAME = re.compile(r"[A-Za-z0-9_.-]+\.png")
#: ASGI scope key of the per-request flags :class:`_CountRequests` sets (``client_gone``).
_SCOPE_KEY = "kvbridge"


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
        self.metrics = ServerMetrics(lambda: float(service.in_flight()), service.pipeline.stage_health)
        service.on_result = self.metrics.observe_result
        self.created = int(time.time())

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

    def check_length(self, prompt: str, max_tokens: int | None) -> None:
        if self.tokenizer is None or self.max_model_len is None:
            return
        n = len(self.tokenizer(prompt).input_ids)
        want = max_tokens or self.default_max_tokens
        if n + want > self.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + want} tokens ({n} in the prompt, {want} for the completion). "
                "Please reduce the length of the prompt or max_tokens.",
                reason="bad_request",
            )

    def chat_prompt(self, req: ChatCompletionRequest) -> str:
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        tok = self.tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
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
        svc = self.service
        self._check_up()
        rid, fut = self._submit(prompt, params, stage_params=stage_params, prefix=prefix)
        waiter = asyncio.wrap_future(fut)
        aborted = False
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if not aborted and self._drained_out():
                    svc.abort(rid, "server shutting down")  # its result comes back as a 503
                    aborted = True
                if await request.is_disconnected():
                    svc.abort(rid, "client disconnected")
                    self.metrics.failures.labels("client_disconnect").inc()
                    raise ClientGone()
        except asyncio.CancelledError:  # server shutdown cancelled the handler
            svc.abort(rid, "server shutting down")
            raise
        return self._checked(rid, waiter)

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
            if request.scope.get(_SCOPE_KEY, {}).get("client_gone"):
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

    def _submit(self, prompt: str, params: dict[str, Any], **kwargs: Any) -> tuple[str, Any]:
        try:
            return self.service.submit(prompt, params, **kwargs)
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


class _CountRequests:
    """Pure ASGI middleware counting responses by route and status (Starlette's
    ``BaseHTTPMiddleware`` would hide client disconnects from the handlers)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [499]  # no response started: the client left first
        # Starlette cancels a streaming response whose client left (it reads the disconnect
        # itself): the flag tells that cancellation from a server shutdown's.
        flags = scope.setdefault(_SCOPE_KEY, {})

        async def watch(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        async def listen() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect":
                flags["client_gone"] = True
            return message

        try:
            await self.app(scope, listen, watch)
        finally:
            route = scope.get("route")
            self.metrics.http_requests.labels(getattr(route, "path", "other"), str(status[0])).inc()


def build_app(
    state: ServerState, *, api_key: str | None = None, open_paths: Iterable[str] = DEFAULT_OPEN_PATHS
) -> FastAPI:
    """The app; the caller owns ``state.service`` (started before, closed on shutdown).
    ``api_key``: require it on every path but ``open_paths`` (:mod:`vllm_kvbridge.server.auth`)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn let in-flight requests finish (or cancelled them); close the rest.
        await asyncio.to_thread(state.service.close, drain_s=0.0)

    app = FastAPI(title="vllm-kvbridge", lifespan=lifespan)
    app.state.kvbridge = state
    m = state.metrics

    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key, open_paths=open_paths)
    app.add_middleware(_CountRequests, metrics=m)  # outermost: 401s are counted too

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        m.failures.labels(exc.reason or ("bad_request" if exc.status < 500 else "error")).inc()
        return JSONResponse(
            error_body(exc.status, exc.message, exc.kind), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        param = None
        for e in exc.errors():
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            param = param or (".".join(loc) or None)
            if e.get("type") == "json_invalid":
                parts.append(f"invalid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
            else:
                parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
        m.failures.labels("bad_request").inc()
        return JSONResponse(
            error_body(400, "; ".join(parts) or "invalid request", "BadRequestError", param), status_code=400
        )

    # -- introspection -----------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        h = state.service.health()
        down = [s for s in h["stages"] if s["status"] != "ready"]
        body = {
            "status": "ok" if h["ok"] else "recovering" if h["recovering"] else "unhealthy",
            "pipeline": state.plan.name,
            "stages": h["stages"],
            "error": h["error"],
        }
        if down:
            body["down"] = [
                f"stage {s['stage_id']} ({s['kind']}): {s.get('error', s['status'])}" for s in down
            ]
        return JSONResponse(body, status_code=200 if h["ok"] else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.served_model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "vllm-kvbridge",
                    "max_model_len": state.max_model_len,
                    "kvbridge": {
                        "pipeline": state.plan.name,
                        "output": state.output_kind,
                        "stages": [{"stage_id": s.stage_id, "kind": s.kind} for s in state.plan.stages],
                    },
                }
            ],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/state")
    async def debug_state() -> dict[str, Any]:
        from vllm_kvbridge.connectors.leftovers import shared_memory_names

        run = state.service.pipeline.run_id
        names = shared_memory_names(run)
        return {
            "run_id": run,
            "in_flight": state.service.in_flight(),
            "in_flight_high_water": state.service.high_water,
            "max_in_flight": state.service.max_in_flight,
            "shm_segments": names,
            # published and not yet consumed payloads/KV caches (pool segments are reused)
            "shm_published": [n for n in names if ".k." in n],
            # request id -> the stages working on it (waiting for a recovering one: absent)
            "requests": state.service.pipeline.request_stages(),
        }

    @app.get("/images/{name}")
    async def image_file(name: str) -> Response:
        if state.output_dir is None or not _IMAGE_NAME.fullmatch(name):
            raise ApiError(404, f"no image {name!r}", "NotFoundError")
        path = state.output_dir / name
        if not path.is_file():
            raise ApiError(404, f"no image {name!r}", "NotFoundError")
        return FileResponse(path, media_type="image/png")

    # -- generation ----------------------------------------------------------------------
    @app.post("/v1/images/generations")
    async def images(body: ImageRequest, request: Request) -> dict[str, Any]:
        from vllm_kvbridge.pipeline.images import encode_png

        t0 = time.perf_counter()
        state.check_model(body.model)
        state.require_output("image")
        if body.response_format == "url" and state.output_dir is None:
            raise ApiError(400, "response_format 'url' needs the server's --output-dir")
        final = state.plan.final_stage
        d = final.diffusion or {}
        size = (d.get("kwargs") or {}).get("image_size")
        if body.size is not None and size is not None and body.size != f"{size}x{size}":
            raise ApiError(
                400, f"size {body.size!r} is not supported by this pipeline (only '{size}x{size}')"
            )
        params: dict[str, Any] = {}
        if body.max_tokens is not None:
            params["max_tokens"] = body.max_tokens
        state.check_length(body.prompt, params.get("max_tokens"))
        base_seed = body.seed if body.seed is not None else int(d.get("seed", 0))
        jobs = []
        for i in range(body.n):
            sp: dict[str, Any] = {"seed": base_seed + i}
            if body.num_steps is not None:
                sp["num_steps"] = body.num_steps
            if body.guidance_scale is not None:
                sp["guidance_scale"] = body.guidance_scale
            if body.negative_prompt is not None:
                sp["negative_prompt"] = body.negative_prompt
            jobs.append(state.run(request, body.prompt, dict(params), {final.stage_id: sp}, prefix="img"))
        results = await asyncio.gather(*jobs)
        data = []
        for r in results:
            png = encode_png(r.image)
            if body.response_format == "b64_json":
                data.append(
                    {"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": body.prompt}
                )
            else:
                assert state.output_dir is not None
                name = f"{r.request_id}-{uuid.uuid4().hex[:8]}.png"
                (state.output_dir / name).write_bytes(png)
                data.append(
                    {"url": str(request.url_for("image_file", name=name)), "revised_prompt": body.prompt}
                )
        m.latency.labels("/v1/images/generations").observe(time.perf_counter() - t0)
        return {"created": int(time.time()), "data": data}

    def _text_endpoint_checks(model: str | None) -> None:
        state.check_model(model)
        state.require_output("text")

    def _usage(r: RequestResult) -> dict[str, int]:
        entry = r.stages[0].output if r.stages else {}
        prompt_tokens = len(entry.get("prompt_token_ids") or [])
        completion_tokens = len(r.token_ids or [])
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def _finish_reason(r: RequestResult, params: dict[str, Any]) -> str:
        final = state.plan.final_stage
        limit = int(
            (params if len(state.plan.stages) == 1 else {}).get("max_tokens")
            or final.default_sampling_params.get("max_tokens")
            or 16
        )
        return "length" if len(r.token_ids or []) >= limit else "stop"

    def _stream(
        request: Request, prompt: str, params: dict[str, Any], chat: bool, cid: str
    ) -> StreamingResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            body = {
                "id": cid,
                "object": obj,
                "created": int(time.time()),
                "model": state.served_model_name,
                "choices": [choice],
            }
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> AsyncIterator[str]:
            t0 = time.perf_counter()
            sent = ""  # the text sent so far
            role = chat  # a chat stream starts with the assistant's role

            def text_chunk(delta: str) -> str:
                nonlocal role
                head, role = (chunk(None, None, role=True) if role else ""), False
                return head + chunk(delta, None)

            result: RequestResult | None = None
            try:
                async with contextlib.aclosing(state.stream(request, prompt, params, prefix="cmpl")) as it:
                    async for item in it:
                        if isinstance(item, StageProgress):
                            if item.text_delta:
                                sent += item.text_delta
                                yield text_chunk(item.text_delta)
                        else:
                            result = item
            except ApiError as exc:
                m.failures.labels(exc.reason or "error").inc()
                yield f"data: {json.dumps(error_body(exc.status, exc.message, exc.kind))}\n\n"
                yield "data: [DONE]\n\n"
                return
            except ClientGone:
                return
            assert result is not None
            text = result.text or ""
            # Whatever progress did not carry (a last stage that does not stream) comes now.
            rest = text[len(sent) :] if text.startswith(sent) else ""
            if rest or role:
                yield text_chunk(rest) if rest else chunk(None, None, role=True)
            yield chunk(None if chat else "", _finish_reason(result, params))
            yield "data: [DONE]\n\n"
            m.latency.labels("/v1/chat/completions" if chat else "/v1/completions").observe(
                time.perf_counter() - t0
            )

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        _text_endpoint_checks(body.model)
        params = body.sampling_params()
        state.check_length(body.text, params.get("max_tokens"))
        cid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            if state.service.failure is not None:
                raise ApiError(503, f"pipeline unavailable: {state.service.failure}", "service_unavailable")
            return _stream(request, body.text, params, False, cid)
        r = await state.run(request, body.text, params, prefix="cmpl")
        m.latency.labels("/v1/completions").observe(time.perf_counter() - t0)
        return {
            "id": cid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "text": r.text or "",
                    "logprobs": None,
                    "finish_reason": _finish_reason(r, params),
                }
            ],
            "usage": _usage(r),
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        _text_endpoint_checks(body.model)
        params = body.sampling_params()
        prompt = state.chat_prompt(body)
        state.check_length(prompt, params.get("max_tokens"))
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            if state.service.failure is not None:
                raise ApiError(503, f"pipeline unavailable: {state.service.failure}", "service_unavailable")
            return _stream(request, prompt, params, True, cid)
        r = await state.run(request, prompt, params, prefix="chat")
        m.latency.labels("/v1/chat/completions").observe(time.perf_counter() - t0)
        return {
            "id": cid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.served_model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": r.text or ""},
                    "finish_reason": _finish_reason(r, params),
                }
            ],
            "usage": _usage(r),
        }

    add_speech_routes(app, state)
    return app
