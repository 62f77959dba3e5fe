"""ASGI middleware: request ids and the one answer to an unhandled exception, the
request body limit and per-endpoint request counts, and the one way every middleware
sends an error."""

from __future__ import annotations

import json
import logging
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.server.http_errors import REQUEST_ID, APIError
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.request_log import REQUEST_RECORD, RequestRecord, log_request, note_error

log = logging.getLogger(__name__)

KNOWN_PATHS = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/cache/stats",
        "/v1/cache/clear",
        "/v1/cache/explain",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/messages/explain",
        "/tokenize",
        "/detokenize",
        "/dashboard",
        "/v1/dashboard/state",
    }
)

# An error's JSON body for a request path (OpenAI's shape, or Anthropic's under
# /v1/messages); the app supplies it, so this module need not import the routes.
ErrorBody = Callable[[str, APIError], dict[str, Any]]


def openai_body(path: str, error: APIError) -> dict[str, Any]:
    return error.body()


class BodyLimitMiddleware:
    """413 for a body over `max_body_bytes`, by Content-Length or by what arrives.

    The body is read in full before the app sees it (FastAPI would buffer it
    anyway), so an oversized chunked body is caught too. On overflow the rest
    is read and dropped, up to a bound, before the 413 goes out: a client
    still writing its body would otherwise see a reset connection instead of
    the answer.
    """

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, error_body: ErrorBody = openai_body
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.error_body = error_body
        self.drain_bytes = max(4 * max_body_bytes, 16 * 1024 * 1024)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared == -1:
            error = APIError(400, "the Content-Length header is not a number")
            await send_error(send, self.error_body(scope["path"], error), error)
            return
        too_large = declared is not None and declared > limit
        chunks: list[bytes] = []
        received = 0
        more = True
        disconnected = False
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                break
            body = message.get("body", b"")
            received += len(body)
            more = message.get("more_body", False)
            if received > limit:
                too_large = True
            if too_large:
                if received > self.drain_bytes:
                    break
                continue
            chunks.append(body)
        if disconnected:
            return
        if too_large:
            size = max(received, declared or 0)
            error = APIError(
                413,
                f"the request body has at least {size} bytes; the limit is {limit} bytes "
                "(raise it with --max-body-bytes)",
                code="body_too_large",
            )
            await send_error(send, self.error_body(scope["path"], error), error)
            return
        replay: list[Message] = [
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        ]

        async def replay_receive() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        await self.app(scope, replay_receive, send)


class RequestMetricsMiddleware:
    """Counts responses by endpoint (unknown paths pooled as "other") and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(path, str(status)).inc()


class RequestIdMiddleware:
    """Gives every request an id: the `x-request-id` response header, `REQUEST_ID` while
    the request is served (so logs and `hidden_error` name it), and the id in the body
    of a 500. When the response is sent, it writes the request's one log line
    (`server/request_log.py`), with the key label `AuthMiddleware` left in the scope.

    Outermost of the app's middlewares, it is where an exception nothing else handled
    ends: it is logged once, with its traceback and the request id, and the client gets
    a generic 500 (when no response has started). It is not re-raised: Starlette's
    own last-resort handler would answer the same and re-raise it to uvicorn, which
    logs the same traceback a second time. The id is always the server's own, never
    one a client sent, so a client cannot forge or collide with another's log lines.
    """

    def __init__(self, app: ASGIApp, error_body: ErrorBody = openai_body) -> None:
        self.app = app
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req_" + uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        client = scope.get("client")
        record = RequestRecord(
            request_id,
            scope["method"],
            scope["path"],
            f"{client[0]}:{client[1]}" if client else "-",
        )
        record_token = REQUEST_RECORD.set(record)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record.status = message["status"]
                headers = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            error = internal_error(scope["method"], scope["path"], exc)
            if not started:
                await send_error(send_with_id, self.error_body(scope["path"], error), error)
        finally:
            record.key_label = _key_label(scope)
            log_request(record)
            REQUEST_RECORD.reset(record_token)
            REQUEST_ID.reset(token)


def _key_label(scope: Scope) -> str:
    tenant = scope.get("state", {}).get("tenant")
    label = getattr(tenant, "label", None)
    return label if isinstance(label, str) else "-"


def internal_error(method: str, path: str, exc: BaseException) -> APIError:
    """Log an unhandled exception (once, with its traceback) and return the 500 the
    client gets: the exception's type and the request id, never its text."""
    request_id = REQUEST_ID.get()
    log.error(
        "request %s: unhandled error on %s %s:\n%s", request_id, method, path, _short_trace(exc)
    )
    return APIError(
        500,
        f"internal error ({type(exc).__name__}); see the server log for request id {request_id}",
        type="server_error",
    )


MAX_TRACE_CHARS = 8000  # a RecursionError's traceback is ~600 KB of one repeated frame


def _short_trace(exc: BaseException) -> str:
    """The traceback of `exc`, its middle cut when long: the head says where the request
    entered, the tail where it failed."""
    text = "".join(traceback.format_exception(exc))
    if len(text) <= MAX_TRACE_CHARS:
        return text
    head, tail = MAX_TRACE_CHARS // 4, MAX_TRACE_CHARS * 3 // 4
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters of traceback cut ...]\n{text[-tail:]}"


def _content_length(scope: Scope) -> int | None:
    """The declared length; None when absent, -1 when unreadable."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                n = int(value)
            except ValueError:
                return -1
            return n if n >= 0 else -1
    return None


async def send_error(send: Send, payload: dict[str, Any], error: APIError) -> None:
    """Answer with `error`'s status and headers and `payload` as the JSON body; the
    request's log line gets its message as the reason."""
    note_error(error.message)
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
