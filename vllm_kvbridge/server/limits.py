"""The request-body limit of ``vllm-kvbridge serve`` (``--max-body-bytes``).

A body over the limit is answered 413 (OpenAI's error body) without being held in memory:
a declared ``Content-Length`` over it is refused before a byte of the body is read, and a
body without one (chunked) is counted as it arrives and cut off at the chunk that crosses
the limit. Whatever the handler made of the cut-off body is dropped for the 413. uvicorn
reads and discards what the client still sends after the answer, so the client gets the
413 instead of a reset connection.

Why a limit at all: every byte of a body is parsed (JSON), validated and, for a prompt,
tokenized; without a bound one client could make the server spend seconds and
gigabytes per request.
"""

from __future__ import annotations

import json
from typing import Any

from vllm_kvbridge.server.errors import error_body

#: The default ``--max-body-bytes``: far above any prompt a context window holds (a
#: 128k-token prompt is well under 1 MiB of JSON), far below what stalls a tokenizer.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyTooLarge(Exception):
    """Raised into the app by ``receive`` once the body passed the limit."""


def _declared_length(scope: Any) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses a malformed one before the app runs
                return None
    return None


class BodyLimit:
    """Pure ASGI middleware: 413 for a request body over ``max_bytes`` (module docstring)."""

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def _too_large(self, send: Any, seen: str) -> None:
        why = f"request body too large: {seen}, the limit (--max-body-bytes) is {self.max_bytes} bytes"
        body = json.dumps(error_body(413, why, "invalid_request_error")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(send, f"Content-Length {declared}")
            return
        received = 0
        over = False
        started = False

        async def counted() -> Any:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge()
            return message

        async def guarded(message: Any) -> None:
            nonlocal started
            if over:
                return  # the handler's answer to a cut-off body: the 413 replaces it
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            # FastAPI turns an error while reading the body into a 400 (dropped above);
            # what reaches here was raised by the cut-off itself.
            if not over:
                raise
        if over and not started:
            await self._too_large(send, f"more than {self.max_bytes} bytes")


__all__ = ["DEFAULT_MAX_BODY_BYTES", "BodyLimit"]
