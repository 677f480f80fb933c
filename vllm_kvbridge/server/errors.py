"""The server's error types, OpenAI's error body (``{"error": {message, type, param, code}}``)
and the handlers that give every answer other than 200 that body: the app's own
:class:`ApiError`, request validation (400), and what FastAPI/Starlette would otherwise
answer as ``{"detail": ...}`` (unknown path, wrong method, an unparsable body) or as a
plain-text 500."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_kvbridge.server.metrics import ServerMetrics

#: OpenAI's error ``type`` by status, for errors raised outside the app's own code.
_KIND_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "NotFoundError",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
}


class ApiError(Exception):
    """An answer other than 200: ``status``, the message, OpenAI's error ``kind``, the
    metrics ``reason`` label, extra response ``headers`` (e.g. ``Retry-After``) and the
    request field at fault (``param``)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        reason: str = "",
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.reason = status, message, kind, reason
        self.headers, self.param = headers, param


class ClientGone(Exception):
    """The client disconnected; its request was aborted."""


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(
    status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind, param), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Make every error ``app`` answers OpenAI's error body (see the module docstring)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.failures.labels(exc.reason or ("bad_request" if exc.status < 500 else "error")).inc()
        return error_response(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        param = None
        for e in exc.errors():
            kind, raw = e.get("type"), e.get("loc", ())
            if kind == "json_invalid":  # its loc is a character offset, not a field
                where, why = (raw[-1] if len(raw) > 1 else "?"), e.get("ctx", {}).get("error", e.get("msg"))
                parts.append(f"invalid JSON at character {where}: {why}")
                continue
            # Field names and list indexes; pydantic also names the union member that was tried
            # ("constrained-str", "list[str]"), which is no field of the request.
            loc = [str(x) for x in raw[1:] if isinstance(x, int) or str(x).isidentifier()]
            param = param or (".".join(loc) or None)
            if kind == "missing" and not loc:
                parts.append("the request needs a JSON body")
            elif kind in ("model_attributes_type", "dict_type") and not loc:
                parts.append("the body must be a JSON object (Content-Type: application/json)")
            else:
                parts.append(f"{'.'.join(loc) or 'body'}: {e.get('msg')}")
        metrics.failures.labels("bad_request").inc()
        return error_response(400, "; ".join(parts) or "invalid request", "BadRequestError", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's own refusals: 404/405 for a path or method it does not serve, and 400
        # "There was an error parsing the body" for a body that is not UTF-8 JSON.
        if exc.status_code < 400:
            return Response(status_code=exc.status_code, headers=exc.headers)
        if exc.status_code < 500:
            metrics.failures.labels("bad_request").inc()
        kind = _KIND_OF_STATUS.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "")
        return error_response(
            exc.status_code, str(exc.detail), kind or "internal_server_error", headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug: Starlette re-raises it after this answer, so uvicorn still logs its traceback.
        metrics.failures.labels("error").inc()
        return error_response(500, f"internal server error: {type(exc).__name__}", "internal_server_error")
