"""What one request, and one key, may ask of the server: messages, content, running requests.

`RequestLimitsMiddleware` refuses a conversation with too many messages or too
much text from the JSON alone: one `json.loads` (C code) and a length check,
before pydantic builds a model per message. Validating 200k messages took
about a second of event-loop time, during which no other request was served;
a cap on the model's fields (`max_length`) would not help, because pydantic
checks a list's length only after validating its items. The body is parsed
again by FastAPI afterwards; the rejected alternative, parsing in each route
instead of FastAPI, would lose the request schemas of the OpenAPI document.

Every field counts: the walk covers the whole body, whatever its fields are
called, with a bound on characters, on JSON values and on nesting depth
(`nesting.MAX_JSON_DEPTH`), so no field the routes ignore or keep as a free-form
dict can cost memory or recursion outside the limits.

`KeyShare` bounds the sequences one key has running (queued in the engine or
generating; a request with `n` samples counts `n`), and is taken before the
request's prompt is tokenized or rendered, so a key that sends a flood meets a
429 while other keys are still served: without it, one key could take every
slot of the engine's queue, or every tokenizer thread.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.server.auth import Tenant
from pagedkv.server.http_errors import APIError, bad_request
from pagedkv.server.middleware import ErrorBody, openai_body, send_error
from pagedkv.server.nesting import MAX_JSON_DEPTH

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
        "/v1/messages/explain",
        "/tokenize",
        "/detokenize",
    }
)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request bounds over every field of the body, named or not. `max_content_chars`
    counts the characters of every string and object key (messages, system prompt,
    prompt, tools and their schemas, `response_format`, `metadata`, fields this server
    ignores); the JSON values in all are at most `PARTS_PER_MESSAGE * max_messages`, and
    no value nests deeper than `MAX_JSON_DEPTH`."""

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
        # Every field, not a list of the known ones: a field the routes ignore or keep
        # as a free-form dict (response_format, metadata, tool schemas) is parsed and
        # held in memory like any other, and used to cost tens of MiB per request.
        budget = _Budget(self.max_content_chars, PARTS_PER_MESSAGE * self.max_messages)
        for field, value in body.items():
            budget.chars -= len(field)
            if not budget.take(value):
                raise budget.refusal(field, self)


_MESSAGE_FIELDS = frozenset({"messages", "system", "prompt"})


class _Budget:
    """Characters and JSON values left, and the depth allowed; `take` walks a value
    without recursion and stops as soon as one runs out, so a huge or deep value costs
    no more than the limit."""

    def __init__(self, chars: int, values: int) -> None:
        self.chars = chars
        self.values = values
        self.over_values = False
        self.too_deep = False

    def take(self, value: Any) -> bool:
        stack: list[tuple[Any, int]] = [(value, 2)]  # the body is level 1
        while stack:
            item, depth = stack.pop()
            self.values -= 1
            if self.values < 0:
                self.over_values = True
                return False
            if isinstance(item, str):
                self.chars -= len(item)
                if self.chars < 0:
                    return False
            elif isinstance(item, dict | list):
                if depth > MAX_JSON_DEPTH:
                    self.too_deep = True
                    return False
                if isinstance(item, dict):
                    for key, inner in item.items():
                        self.chars -= len(key)
                        stack.append((inner, depth + 1))
                else:
                    stack.extend((inner, depth + 1) for inner in item)
        return self.chars >= 0

    def refusal(self, field: str, limits: RequestLimits) -> APIError:
        if self.too_deep:
            return bad_request(
                f"{field}: the JSON nests deeper than {MAX_JSON_DEPTH} levels of arrays and "
                "objects, the most this server takes; flatten it",
                field,
                code="nesting_too_deep",
            )
        most = PARTS_PER_MESSAGE * limits.max_messages
        if self.over_values and field in _MESSAGE_FIELDS:
            return bad_request(
                f"{field}: the request has more than {PARTS_PER_MESSAGE} content parts per "
                f"message allowed ({most} in all); send fewer parts (the operator can raise "
                "--max-messages)",
                field,
                code="too_many_content_parts",
            )
        if self.over_values:
            return bad_request(
                f"{field}: the request has more than {most} JSON values (strings, numbers, "
                f"arrays, objects) in all, the most this server takes ({PARTS_PER_MESSAGE} "
                "per allowed message); send less (the operator can raise --max-messages)",
                field,
                code="too_many_values",
            )
        return bad_request(
            f"{field}: the request's text (every string and key, in any field) is over "
            f"{limits.max_content_chars} characters, the most this server takes (the "
            "operator can raise it with --max-content-chars)",
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
        raise bad_request(
            f"the body's JSON nests deeper than {MAX_JSON_DEPTH} levels of arrays and objects, "
            "the most this server takes; flatten it",
            code="nesting_too_deep",
        ) from None


class KeyShare:
    """At most `limit` running sequences per key: a generating request counts its `n`
    samples (each takes an engine slot and its KV), a prompt-only request (count_tokens,
    explain, tokenize, detokenize) counts 1 while its prompt is rendered. `ANONYMOUS`
    (no keys configured) is not limited, being every caller at once. Thread-safe; every
    `acquire` returns a `ShareHeld` whose `release` gives the sequences back exactly once."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._running: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, tenant: Tenant, n: int = 1) -> ShareHeld:
        """Take `n` sequences of `tenant`'s share, or raise: 429 when the key has too many
        running now, 400 when `n` alone is over its share (waiting would never help)."""
        if self.limit is None or tenant.salt is None:
            return ShareHeld(self, tenant, 0)
        if n > self.limit:
            raise bad_request(
                f"the request asks for n={n} sequences but this API key's share of the "
                f"server is {self.limit} running sequences; lower n to at most {self.limit} "
                "(the operator can raise it with --max-requests-per-key)",
                "n",
                code="key_share_exceeded",
            )
        with self._lock:
            running = self._running.get(tenant.salt, 0)
            if running + n > self.limit:
                raise APIError(
                    429,
                    f"this API key has {running} sequences running (a request counts each "
                    f"of its n samples) and this request asks for {n}; its share of the "
                    f"server is {self.limit}; wait for one to finish (the operator can "
                    "raise it with --max-requests-per-key)",
                    code="key_share_exceeded",
                    headers={"Retry-After": "1"},
                )
            self._running[tenant.salt] = running + n
        return ShareHeld(self, tenant, n)

    def _release(self, tenant: Tenant, n: int) -> None:
        if n == 0 or tenant.salt is None:
            return
        with self._lock:
            left = self._running.get(tenant.salt, 0) - n
            if left > 0:
                self._running[tenant.salt] = left
            else:
                self._running.pop(tenant.salt, None)

    def running(self, tenant: Tenant) -> int:
        """The sequences `tenant` has running."""
        with self._lock:
            return self._running.get(tenant.salt or "", 0)


class ShareHeld:
    """Sequences taken from a key's share. `release` is idempotent, so the error path of
    a route and the close of its generation may both call it; also a context manager."""

    __slots__ = ("_n", "_share", "_tenant")

    def __init__(self, share: KeyShare, tenant: Tenant, n: int) -> None:
        self._share = share
        self._tenant = tenant
        self._n = n

    def release(self) -> None:
        n, self._n = self._n, 0
        self._share._release(self._tenant, n)

    @contextmanager
    def released_on_error(self) -> Iterator[ShareHeld]:
        """Keep the sequences when the block succeeds (a generation now owns them and
        releases them when it closes); give them back when it raises."""
        try:
            yield self
        except BaseException:
            self.release()
            raise

    def __enter__(self) -> ShareHeld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
