"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a status.

What a client reads is text pagedkv wrote. An exception whose text a library or
the engine's internals wrote (a tokenizer's, torch's, the one that killed the
worker) can name internals or another request's data: it becomes a generic
message carrying the request's id (`hidden_error`), and its own text goes to
the log under that id. The id is the `x-request-id` response header
(`server/middleware.py` assigns it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextvars import ContextVar

from fastapi.responses import JSONResponse

from pagedkv.errors import (
    EngineOverloadedError,
    OutOfBlocksError,
    PagedKVError,
    RequestTooLargeError,
    UnknownAdapterError,
)

log = logging.getLogger(__name__)

# The id of the request being served; set by RequestIdMiddleware for the request's task.
REQUEST_ID: ContextVar[str] = ContextVar("pagedkv_request_id", default="-")

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


def hidden_error(
    status: int,
    message: str,
    exc: BaseException,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> APIError:
    """`message` and the request id for the client; `exc`'s own text for the log only."""
    request_id = REQUEST_ID.get()
    log.warning("request %s: %s: %s: %s", request_id, message, type(exc).__name__, exc)
    return APIError(
        status,
        f"{message} (request id {request_id}; the detail is in the server log)",
        param=param,
        code=code,
        headers=headers,
    )


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
    if isinstance(exc, UnknownAdapterError):  # unloaded since the route looked
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, OutOfBlocksError):
        return APIError(
            503,
            f"the KV cache is full: {exc}",
            code="out_of_kv_blocks",
            headers={"Retry-After": str(RETRY_AFTER_OVERLOADED_S)},
        )
    if closing:
        return shutting_down()
    # The typed refusals above carry messages pagedkv wrote from numbers. The rest may
    # carry foreign text: a closed engine's reason quotes the exception that killed
    # its worker, and a ValueError may be torch's or the tokenizer's.
    if isinstance(exc, PagedKVError):  # the engine is closed or cannot serve right now
        return hidden_error(
            503,
            "the engine cannot serve requests now; retry later or on another replica",
            exc,
            code="engine_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)},
        )
    if isinstance(exc, ValueError | TypeError):
        return hidden_error(400, "the engine refused the request", exc)
    return None
