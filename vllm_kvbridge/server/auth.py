"""API-key authentication of ``vllm-kvbridge serve`` (``--api-key`` / ``VLLM_KVBRIDGE_API_KEY``).

Checked like ``vllm serve --api-key``: a request must carry ``Authorization: Bearer <key>``
(what the ``openai`` client sends for its ``api_key``; the scheme in any case, as RFC 7235
has it); otherwise the answer is 401 with OpenAI's error body, before any handler runs.
Unlike vLLM, every path is protected except those named open (``--unauthenticated-paths``,
default ``/health`` and ``/metrics``, which probes and scrapers call without credentials;
give ``""`` to protect them too). On an open path a valid key still counts: the request is
marked authenticated (``scope["kvbridge"]["authenticated"]``), and ``/health`` shows the
stages' pids only to such a caller.

What this covers: the HTTP API only. TLS for it is uvicorn's (``--ssl-keyfile`` /
``--ssl-certfile``). The data planes between stages are not behind this key (see
docs/serving.md, "What is authenticated").
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Iterable
from typing import Any

from vllm_kvbridge.server.errors import error_body

#: ASGI scope key of the per-request flags the middlewares set (``authenticated`` here,
#: ``client_gone`` by the app's request counter) for the handlers.
SCOPE_KEY = "kvbridge"

#: Environment variable read when ``--api-key`` is not given.
API_KEY_ENV = "VLLM_KVBRIDGE_API_KEY"
DEFAULT_OPEN_PATHS = ("/health", "/metrics")


def api_key_from(arg: str | None) -> str | None:
    """The key to require: ``--api-key``, else :data:`API_KEY_ENV`, else None (no auth)."""
    key = arg if arg is not None else os.environ.get(API_KEY_ENV)
    return key or None


def open_paths_from(arg: str | None) -> frozenset[str]:
    """``--unauthenticated-paths`` (comma-separated) as a set; None gives the defaults."""
    if arg is None:
        return frozenset(DEFAULT_OPEN_PATHS)
    return frozenset(p.strip() for p in arg.split(",") if p.strip())


class ApiKeyAuth:
    """Pure ASGI middleware: 401 for a request without the key (see the module docstring)."""

    def __init__(self, app: Any, api_key: str, open_paths: Iterable[str] = DEFAULT_OPEN_PATHS) -> None:
        if not api_key:
            raise ValueError("ApiKeyAuth needs a non-empty key")
        self.app = app
        self._expected = api_key.encode()
        self.open_paths = frozenset(open_paths)

    def _authorized(self, scope: Any) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = bytes(value).strip().partition(b" ")
                # Constant time: a timing side channel must not reveal the key byte by byte.
                same = hmac.compare_digest(token.strip(), self._expected)
                return scheme.lower() == b"bearer" and same
        return False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorized = self._authorized(scope)
        scope.setdefault(SCOPE_KEY, {})["authenticated"] = authorized
        if authorized or scope.get("path") in self.open_paths:
            await self.app(scope, receive, send)
            return
        why = "Unauthorized: a valid API key is required (Authorization: Bearer <key>)"
        body = json.dumps(error_body(401, why, "authentication_error")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})


__all__ = ["API_KEY_ENV", "SCOPE_KEY", "ApiKeyAuth", "api_key_from", "open_paths_from"]
