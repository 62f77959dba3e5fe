"""Errors in Anthropic's shape: `{"type": "error", "error": {"type": ..., "message": ...}}`."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pagedkv.server.http_errors import APIError

PREFIX = "/v1/messages"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(exc: APIError) -> dict[str, Any]:
    kind = _TYPES.get(exc.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)
