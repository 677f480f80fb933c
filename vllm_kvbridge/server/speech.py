"""``POST /v1/audio/speech``: pipelines that end in a vocoder stage (thinker -> talker ->
vocoder), in OpenAI's speech API shape.

``stream_format: "audio"`` (the default) answers the whole file once the request is done:
``response_format: "wav"`` (mono 16-bit) or ``"pcm"`` (raw 16-bit little-endian; the
sample rate is in the ``X-Sample-Rate`` header). ``stream_format: "sse"`` answers as
server-sent events while the pipeline runs: one ``{"type": "speech.audio.delta", "audio":
<base64 16-bit PCM>}`` per piece of audio **as the vocoder makes it** (each arriving chunk
of the talker's codes becomes a piece at once, so the first audio leaves while the talker
still generates), then ``{"type": "speech.audio.done", "usage": ...}``. The pieces
concatenate to the ``pcm`` answer of the same request. A request that fails after the
stream started ends with an ``{"type": "error", "error": {...}}`` event (OpenAI's error
body), its status being 200 already.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from vllm_kvbridge.pipeline.audio import encode_pcm16, encode_wav
from vllm_kvbridge.pipeline.messages import StageProgress, tensor_from_msg
from vllm_kvbridge.pipeline.results import RequestResult
from vllm_kvbridge.server.errors import ApiError, ClientGone, error_body
from vllm_kvbridge.server.protocol import SpeechRequest
from vllm_kvbridge.server.state import ServerState

ROUTE = "/v1/audio/speech"


def _usage(r: RequestResult) -> dict[str, int]:
    entry = r.stages[0].output if r.stages else {}
    inputs = len(entry.get("prompt_token_ids") or [])
    outputs = int((r.stages[-1].output if r.stages else {}).get("rows") or 0)  # codes vocoded
    return {"input_tokens": inputs, "output_tokens": outputs, "total_tokens": inputs + outputs}


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def add_speech_routes(app: FastAPI, state: ServerState) -> None:
    """Add ``POST /v1/audio/speech`` to ``app``, served from ``state``."""
    metrics = state.metrics

    async def events(request: Request, prompt: str, params: dict[str, Any]) -> AsyncIterator[str]:
        t0 = time.perf_counter()
        sent = 0  # samples streamed so far
        result: RequestResult | None = None
        try:
            async with contextlib.aclosing(state.stream(request, prompt, params, prefix="speech")) as it:
                async for item in it:
                    if isinstance(item, StageProgress):
                        if item.audio_delta is not None:
                            piece = tensor_from_msg(item.audio_delta)
                            sent += len(piece)
                            audio = base64.b64encode(encode_pcm16(piece)).decode("ascii")
                            yield _event({"type": "speech.audio.delta", "audio": audio})
                    else:
                        result = item
        except ApiError as exc:
            metrics.failures.labels(exc.reason or "error").inc()
            yield _event({"type": "error", **error_body(exc.status, exc.message, exc.kind)})
            return
        except ClientGone:
            return
        assert result is not None
        if result.audio is not None and len(result.audio) > sent:  # what progress did not carry
            rest = base64.b64encode(encode_pcm16(result.audio[sent:])).decode("ascii")
            yield _event({"type": "speech.audio.delta", "audio": rest})
        yield _event({"type": "speech.audio.done", "usage": _usage(result)})
        metrics.latency.labels(ROUTE).observe(time.perf_counter() - t0)

    @app.post(ROUTE, response_model=None)
    async def speech(body: SpeechRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        state.check_model(body.model)
        state.require_output("audio")
        params: dict[str, Any] = {}
        for name in ("max_tokens", "seed"):
            if getattr(body, name) is not None:
                params[name] = getattr(body, name)
        await state.check_length(body.input, params.get("max_tokens"), param="input")
        if body.stream_format == "sse":
            if state.service.failure is not None:
                raise ApiError(503, f"pipeline unavailable: {state.service.failure}", "service_unavailable")
            return StreamingResponse(events(request, body.input, params), media_type="text/event-stream")
        r = await state.run(request, body.input, params, prefix="speech")
        rate = int(r.sample_rate or 0)
        # Encoding the whole clip blocks: off the event loop (the SSE deltas are small pieces).
        if body.response_format == "wav":
            content, media = await asyncio.to_thread(encode_wav, r.audio, rate), "audio/wav"
        else:
            content, media = await asyncio.to_thread(encode_pcm16, r.audio), "audio/pcm"
        metrics.latency.labels(ROUTE).observe(time.perf_counter() - t0)
        return Response(content, media_type=media, headers={"X-Sample-Rate": str(rate)})
