"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations

from collections.abc import Mapping

from fastapi.responses import JSONResponse

from pagedkv.errors import (
    EngineOverloadedError,
    OutOfBlocksError,
    PagedKVError,
    RequestTooLargeError,
)

RETRY_AFTER_OVERLOADED_S = 1
RETRY_AFTER_UNAVAILABLE_S = 5

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the client gets as JSON; raised anywhere in a request handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down; retry against another replica or later",
        code="server_shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
    )


def from_engine_error(exc: BaseException, *, closing: bool) -> APIError | None:
    """The client-facing form of an exception the engine raised; None: a server bug."""
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            429,
            f"the server is busy: {exc}",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_OVERLOADED_S)},
        )
    if isinstance(exc, RequestTooLargeError):
        return bad_request(str(exc), "max_tokens", code="request_too_large")
    if isinstance(exc, OutOfBlocksError):
        return APIError(
            503,
            f"the KV cache is full: {exc}",
            code="out_of_kv_blocks",
            headers={"Retry-After": str(RETRY_AFTER_OVERLOADED_S)},
        )
    if closing:
        return shutting_down()
    if isinstance(exc, PagedKVError):  # the engine is closed or cannot serve right now
        return APIError(
            503,
            f"the engine cannot serve requests: {exc}",
            code="engine_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
        )
    if isinstance(exc, ValueError | TypeError):
        return bad_request(str(exc))
    return None
