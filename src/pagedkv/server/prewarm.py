"""`POST /v1/cache/prewarm`, and the after-turn store of reasoning-aware storing.

Prewarm: a chat completion body, or an Anthropic Messages body (`?format=messages`,
or any request with an `anthropic-version` header, which Anthropic's SDKs always
send), rendered exactly as its generating route would render it, then prefilled
and stored without generating (`Engine.prewarm_stream`). It takes one sequence
of the key's share while it runs and goes through the engine's queue, KV budget
and fair admission like any request; it is answered once the prefix is stored.
Fields a generating route reads only to sample (`max_tokens`, `temperature`...)
are accepted and unused: they cannot change the prompt.

After a chat turn that ended normally, `after_turn` hands the conversation with
its answer to `Engine.store_next_turn` on the render pool: with a template that
strips reasoning, the engine stores the next request's form of the turn in the
background (`engine/reasoning.py`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedkv.engine.request import GenerationResult
from pagedkv.model.vision import ImagePrompt
from pagedkv.server.anthropic.convert import to_chat_request
from pagedkv.server.anthropic.explain import (
    MessagesExplainRequest,
    refuse_unknown_messages_fields,
)
from pagedkv.server.auth import Tenant
from pagedkv.server.authn import TenantDep
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.http_errors import APIError, bad_request, from_engine_error
from pagedkv.server.limits import ShareHeld
from pagedkv.server.prepare import chat_messages, check_prompt_fits, check_supported
from pagedkv.server.protocol import ERRORS, ChatCompletionRequest
from pagedkv.server.render_pool import RenderPool
from pagedkv.server.tools.output import ToolMode
from pagedkv.server.tools.request import template_tools
from pagedkv.server.unknown_fields import refuse_unknown_fields

log = logging.getLogger(__name__)

# The request's prompt with its images' spans (`app.chat_render`).
ChatRender = Callable[
    [ChatCompletionRequest, Tenant], Awaitable[tuple[ImagePrompt, ToolMode | None]]
]


@dataclass(frozen=True)
class PrewarmContext:
    engine: EngineAPI
    model_name: str
    check_open: Callable[[str | None], None]
    chat_render: ChatRender  # the caller holds the key's share
    admit: Callable[[Tenant, int], ShareHeld]


def add_prewarm_route(app: FastAPI, ctx: PrewarmContext) -> None:
    @app.post("/v1/cache/prewarm", responses=ERRORS)
    async def cache_prewarm(request: Request, tenant: TenantDep) -> Response:
        """Prefill and store this request's prompt without generating; answered once it
        is stored: `prompt_tokens`, `cached_tokens` (found before), `stored_tokens`."""
        chat = _chat_body(request, await _json(request))
        ctx.check_open(chat.model)
        with ctx.admit(tenant, 1):
            prompt, _ = await ctx.chat_render(chat, tenant)
            check_prompt_fits(len(prompt.token_ids), ctx.engine.max_context, "messages")
            salt = tenant.cache_salt(chat.cache_salt)
            run = functools.partial(
                ctx.engine.prewarm, prompt.token_ids, cache_salt=salt, owner=tenant.salt,
                images=prompt.images,
            )  # fmt: skip
            try:
                result: GenerationResult = await to_thread.run_sync(run)
            except Exception as exc:
                api_error = from_engine_error(exc, closing=False)
                if api_error is None:
                    raise
                raise api_error from exc
        return JSONResponse(
            {
                "object": "cache.prewarm",
                "model": ctx.model_name,
                "prompt_tokens": result.prompt_tokens,
                "cached_tokens": result.cached_tokens,
                "stored_tokens": result.stored_tokens,
            }
        )


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise bad_request("the body is not valid JSON") from exc


def _chat_body(request: Request, data: Any) -> ChatCompletionRequest:
    """The body as a chat completion request: a Messages body is converted."""
    fmt = request.query_params.get("format")
    if fmt not in (None, "chat", "messages"):
        raise bad_request(f"format must be 'chat' or 'messages', got {fmt!r}", "format")
    messages = fmt == "messages" or (fmt is None and "anthropic-version" in request.headers)
    try:
        if messages:
            anthropic = MessagesExplainRequest.model_validate(data)
            refuse_unknown_messages_fields(anthropic)
            return to_chat_request(anthropic)
        chat = ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc
    refuse_unknown_fields(chat, "/v1/cache/prewarm", "an OpenAI chat completion body")
    check_supported(chat)
    return chat


class AfterTurn:
    """Hands each finished chat turn to `Engine.store_next_turn` on the render pool.
    Only a turn that ended normally with one sample (its answer is the history the
    client continues); tasks are kept until done so none is collected mid-flight."""

    def __init__(self, engine: EngineAPI, render: RenderPool) -> None:
        self._engine = engine
        self._render = render
        self._tasks: set[asyncio.Future[Any]] = set()

    def finished(
        self,
        body: ChatCompletionRequest,
        ids: list[int],
        result: GenerationResult,
        message: dict[str, Any],
        salt: str | None,
        owner: str | None,
    ) -> None:
        if not getattr(self._engine, "reasoning_active", False):
            return
        try:
            history = [*chat_messages(body), message]
        except APIError:
            return
        follow = "tool" if message.get("tool_calls") else "user"
        store = functools.partial(
            self._engine.store_next_turn,
            history,
            ids + list(result.token_ids),
            tools=template_tools(body),
            follow=follow,
            cache_salt=salt,
            owner=owner,
        )
        task = asyncio.ensure_future(self._run(store, owner))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, store: Callable[[], Any], owner: str | None) -> None:
        try:
            await self._render.run(owner, store)
        except Exception:  # a failed store costs the next turn a recompute, nothing more
            log.warning("storing the next turn's form failed", exc_info=True)
