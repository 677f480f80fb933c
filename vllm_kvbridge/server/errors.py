"""The server's error types and OpenAI's error body (``{"error": {message, type, param, code}}``)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An answer other than 200: ``status``, the message, OpenAI's error ``kind``, the
    metrics ``reason`` label, and extra response ``headers`` (e.g. ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        reason: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.reason = status, message, kind, reason
        self.headers = headers


class ClientGone(Exception):
    """The client disconnected; its request was aborted."""


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
