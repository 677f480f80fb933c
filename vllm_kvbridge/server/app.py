"""The FastAPI app of ``vllm-kvbridge serve`` (OpenAI-compatible where an endpoint fits).

Endpoints: ``POST /v1/images/generations`` (pipelines ending in a diffusion stage),
``POST /v1/completions`` and ``POST /v1/chat/completions`` (pipelines ending in an LLM
stage; ``stream: true`` answers as server-sent events, one chunk per piece of text the
last stage reports while it generates), ``POST /v1/audio/speech`` (pipelines ending in a
vocoder stage; :mod:`vllm_kvbridge.server.speech`), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /debug/state`` (the last three and who sees what:
:mod:`vllm_kvbridge.server.introspection`), ``GET /images/{name}`` (images returned as URLs).

Error contract (OpenAI's ``{"error": {"message", "type", "param", "code"}}`` body, for every
error: :mod:`vllm_kvbridge.server.errors`): 400 bad JSON / schema / too-long prompt or
negative prompt / wrong endpoint for this pipeline, 401 no valid API key (with
``--api-key``), 404 unknown model or path, 413 a body over ``--max-body-bytes``
(:mod:`vllm_kvbridge.server.limits`), 429 ``max_in_flight`` requests are in flight (with
``Retry-After``; an ``n``-image request is admitted or refused whole), 502 the stage the
request was in crashed or stalled (it is restarted: see ``pipeline/supervision.py``), 503 a
stage is restarted meanwhile (with ``Retry-After``), is down for good, or the server is
shutting down, 504 the request outlived ``runtime.request_timeout``, 500 a stage failed the
request. A request never waits longer than the pipeline's ``request_timeout``. A client that
disconnects has its request aborted in every stage (status 499 in the metrics). Nothing
slow (tokenizing, PNG/WAV encoding) runs on the event loop, which also answers ``/health``.
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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from vllm_kvbridge.pipeline.messages import StageProgress
from vllm_kvbridge.pipeline.orchestrator import RequestResult
from vllm_kvbridge.server.auth import DEFAULT_OPEN_PATHS, SCOPE_KEY, ApiKeyAuth
from vllm_kvbridge.server.errors import ApiError, ClientGone, error_body, install_error_handlers
from vllm_kvbridge.server.introspection import add_introspection_routes
from vllm_kvbridge.server.limits import DEFAULT_MAX_BODY_BYTES, BodyLimit
from vllm_kvbridge.server.metrics import ServerMetrics
from vllm_kvbridge.server.protocol import ChatCompletionRequest, CompletionRequest, ImageRequest
from vllm_kvbridge.server.speech import add_speech_routes
from vllm_kvbridge.server.state import ServerState

__all__ = ["ServerState", "build_app"]

_IMAGE_NAME = re.compile(r"[A-Za-z0-9_.-]+\.png")


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
        flags = scope.setdefault(SCOPE_KEY, {})

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
    state: ServerState,
    *,
    api_key: str | None = None,
    open_paths: Iterable[str] = DEFAULT_OPEN_PATHS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    debug_endpoints: bool = False,
) -> FastAPI:
    """The app; the caller owns ``state.service`` (started before, closed on shutdown).
    ``api_key``: require it on every path but ``open_paths`` (:mod:`vllm_kvbridge.server.auth`);
    ``max_body_bytes``: answer a larger request body 413 (:mod:`vllm_kvbridge.server.limits`);
    ``debug_endpoints``: without a key, open ``/debug/state`` and the pids in ``/health``
    (:mod:`vllm_kvbridge.server.introspection`)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # uvicorn let in-flight requests finish (or cancelled them); close the rest.
        await asyncio.to_thread(state.service.close, drain_s=0.0)

    app = FastAPI(title="vllm-kvbridge", lifespan=lifespan)
    app.state.kvbridge = state
    m = state.metrics

    # Innermost first: the body is counted only for a request the key let in.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key, open_paths=open_paths)
    app.add_middleware(_CountRequests, metrics=m)  # outermost: 401s and 413s are counted too

    install_error_handlers(app, m)
    add_introspection_routes(app, state, api_key=api_key, debug_endpoints=debug_endpoints)

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
        await state.check_length(body.prompt, params.get("max_tokens"))
        if body.negative_prompt is not None:
            # The CFG companion is its own prefill-only request (one token) on the first stage.
            await state.check_length(body.negative_prompt, 1, param="negative_prompt")
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
            jobs.append((body.prompt, dict(params), {final.stage_id: sp}))
        # All n images are admitted (and fail) together: a refused request starts none.
        results = await state.run_many(request, jobs, prefix="img")

        def encode(r: RequestResult) -> dict[str, Any]:
            png = encode_png(r.image)
            if body.response_format == "b64_json":
                return {"b64_json": base64.b64encode(png).decode("ascii"), "revised_prompt": body.prompt}
            assert state.output_dir is not None
            name = f"{r.request_id}-{uuid.uuid4().hex[:8]}.png"
            (state.output_dir / name).write_bytes(png)
            return {"url": str(request.url_for("image_file", name=name)), "revised_prompt": body.prompt}

        # PNG encoding and the file write block: off the event loop, like tokenizing.
        data = await asyncio.to_thread(lambda: [encode(r) for r in results])
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

    def _envelope(cid: str, obj: str, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
        # What every completion answer and stream chunk is wrapped in (OpenAI's shape).
        return {
            "id": cid,
            "object": obj,
            "created": int(time.time()),
            "model": state.served_model_name,
            "choices": [choice],
            **extra,
        }

    def _stream(
        request: Request, prompt: str, params: dict[str, Any], chat: bool, cid: str
    ) -> StreamingResponse:
        # A failed pipeline is answered 503 here, before the 200 a stream starts with.
        if state.service.failure is not None:
            raise ApiError(503, f"pipeline unavailable: {state.service.failure}", "service_unavailable")
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta is not None:
                    d["content"] = delta
                choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            return f"data: {json.dumps(_envelope(cid, obj, choice))}\n\n"

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
        await state.check_length(body.text, params.get("max_tokens"))
        cid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _stream(request, body.text, params, False, cid)
        r = await state.run(request, body.text, params, prefix="cmpl")
        m.latency.labels("/v1/completions").observe(time.perf_counter() - t0)
        choice = {
            "index": 0,
            "text": r.text or "",
            "logprobs": None,
            "finish_reason": _finish_reason(r, params),
        }
        return _envelope(cid, "text_completion", choice, usage=_usage(r))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        _text_endpoint_checks(body.model)
        params = body.sampling_params()
        prompt = await state.chat_prompt(body)
        await state.check_length(prompt, params.get("max_tokens"))
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _stream(request, prompt, params, True, cid)
        r = await state.run(request, prompt, params, prefix="chat")
        m.latency.labels("/v1/chat/completions").observe(time.perf_counter() - t0)
        message = {"role": "assistant", "content": r.text or ""}
        choice = {"index": 0, "message": message, "finish_reason": _finish_reason(r, params)}
        return _envelope(cid, "chat.completion", choice, usage=_usage(r))

    add_speech_routes(app, state)
    return app
