"""What one request, and one key, may ask of the server: messages, content, running requests.

`RequestLimitsMiddleware` refuses a conversation with too many messages or too
much text from the JSON alone: one `json.loads` (C code) and a length check,
before pydantic builds a model per message. Validating 200k messages took
about a second of event-loop time, during which no other request was served;
a cap on the model's fields (`max_length`) would not help, because pydantic
checks a list's length only after validating its items. The body is parsed
again by FastAPI afterwards; the rejected alternative, parsing in each route
instead of FastAPI, would lose the request schemas of the OpenAPI document.

`KeyShare` bounds the requests one key has running (queued in the engine or
generating), so a key that sends a flood meets a 429 while other keys are
still served: without it, one key could take every slot of the engine's queue.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.server.auth import Tenant
from pagedkv.server.http_errors import APIError, bad_request
from pagedkv.server.middleware import ErrorBody, openai_body, send_error

DEFAULT_MAX_MESSAGES = 2048
DEFAULT_MAX_CONTENT_CHARS = 4_000_000  # ~1M tokens: more than any context served here
PARTS_PER_MESSAGE = 16  # content parts (blocks) allowed per message, on average
_LIMITED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/cache/explain",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request bounds. `max_content_chars` counts the characters of every string in
    the messages (text, tool arguments, tool results), the system prompt and a
    completion's prompt."""

    max_messages: int = DEFAULT_MAX_MESSAGES
    max_content_chars: int = DEFAULT_MAX_CONTENT_CHARS

    def check(self, body: Any) -> None:
        """Raise APIError(400) naming the limit and its flag when `body` is over one."""
        if not isinstance(body, dict):
            return  # not a request object: the route's validation says what is wrong
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > self.max_messages:
            raise bad_request(
                f"the request has {len(messages)} messages; this server takes at most "
                f"{self.max_messages} (the operator can raise it with --max-messages)",
                "messages",
                code="too_many_messages",
            )
        budget = _Budget(self.max_content_chars, PARTS_PER_MESSAGE * self.max_messages)
        for field in ("messages", "system", "prompt"):
            if field in body and not budget.take(body[field]):
                raise budget.refusal(field, self)


class _Budget:
    """Characters and JSON values left; `take` walks a value without recursion and stops
    as soon as either runs out, so a huge value costs no more than the limit."""

    def __init__(self, chars: int, values: int) -> None:
        self.chars = chars
        self.values = values
        self.over_values = False

    def take(self, value: Any) -> bool:
        stack = [value]
        while stack:
            item = stack.pop()
            self.values -= 1
            if self.values < 0:
                self.over_values = True
                return False
            if isinstance(item, str):
                self.chars -= len(item)
                if self.chars < 0:
                    return False
            elif isinstance(item, dict):
                for key, inner in item.items():
                    self.chars -= len(key)
                    stack.append(inner)
            elif isinstance(item, list):
                stack.extend(item)
        return self.chars >= 0

    def refusal(self, field: str, limits: RequestLimits) -> APIError:
        if self.over_values:
            return bad_request(
                f"{field}: the request has more than {PARTS_PER_MESSAGE} content parts per "
                f"message allowed ({PARTS_PER_MESSAGE * limits.max_messages} in all); send "
                "fewer parts (the operator can raise --max-messages)",
                field,
                code="too_many_content_parts",
            )
        return bad_request(
            f"{field}: the request's text is over {limits.max_content_chars} characters, the "
            "most this server takes (the operator can raise it with --max-content-chars)",
            field,
            code="content_too_large",
        )


class RequestLimitsMiddleware:
    """Applies `RequestLimits` to the JSON body of the generating and explaining routes.
    Runs inside `BodyLimitMiddleware`, so the body is whole and already size-checked."""

    def __init__(
        self, app: ASGIApp, limits: RequestLimits, error_body: ErrorBody = openai_body
    ) -> None:
        self.app = app
        self.limits = limits
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if scope["path"] not in _LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        first = await receive()
        if first["type"] == "http.request" and not first.get("more_body", False):
            try:
                self.limits.check(_loads(first.get("body", b"")))
            except APIError as exc:
                await send_error(send, self.error_body(scope["path"], exc), exc)
                return
        replay: list[Message] = [first]

        async def replay_receive() -> Message:
            if replay:
                return replay.pop()
            return await receive()

        await self.app(scope, replay_receive, send)


def _loads(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None  # FastAPI parses it again and answers with the position of the error
    except RecursionError:
        raise bad_request("the body's JSON is nested too deeply") from None


class KeyShare:
    """At most `limit` running requests per key; `ANONYMOUS` (no keys configured) is not
    limited, being every caller at once. Thread-safe; `acquire` and `release` pair up."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._running: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, tenant: Tenant) -> None:
        if self.limit is None or tenant.salt is None:
            return
        with self._lock:
            running = self._running.get(tenant.salt, 0)
            if running >= self.limit:
                raise APIError(
                    429,
                    f"this API key has {running} requests running, its share of the server "
                    f"is {self.limit}; wait for one to finish (the operator can raise it "
                    "with --max-requests-per-key)",
                    code="key_share_exceeded",
                    headers={"Retry-After": "1"},
                )
            self._running[tenant.salt] = running + 1

    def release(self, tenant: Tenant) -> None:
        if self.limit is None or tenant.salt is None:
            return
        with self._lock:
            left = self._running.get(tenant.salt, 0) - 1
            if left > 0:
                self._running[tenant.salt] = left
            else:
                self._running.pop(tenant.salt, None)

    def running(self, tenant: Tenant) -> int:
        with self._lock:
            return self._running.get(tenant.salt or "", 0)
