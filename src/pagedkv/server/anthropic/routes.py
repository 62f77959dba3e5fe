"""`POST /v1/messages`, `POST /v1/messages/count_tokens` and `POST /v1/messages/explain`.

The routes borrow the OpenAI app's machinery through `MessagesContext` (the
model check, the chat prompt with tools, starting a generation), so both APIs
validate, render and cache a conversation the same way. Errors under
/v1/messages are rendered in Anthropic's shape by the app's error handlers
(`errors.is_messages_path`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from anyio import to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedkv.model.vision import ImagePrompt
from pagedkv.server.anthropic.breakpoints import breakpoints, lease_requests
from pagedkv.server.anthropic.convert import chat_origins, to_chat_request
from pagedkv.server.anthropic.explain import (
    MessagesExplainRequest,
    refuse_unknown_messages_fields,
    section_in_messages,
)
from pagedkv.server.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    MessagesRequest,
    ThinkingConfig,
)
from pagedkv.server.anthropic.render import AnthropicReply, ReplyOptions
from pagedkv.server.auth import Tenant
from pagedkv.server.authn import TenantDep
from pagedkv.server.explain import SectionMap
from pagedkv.server.generation import Generation
from pagedkv.server.http_errors import bad_request
from pagedkv.server.limits import ShareHeld
from pagedkv.server.prepare import chat_messages
from pagedkv.server.protocol import ChatCompletionRequest
from pagedkv.server.sections import PromptSection, Render
from pagedkv.server.tools.output import ToolMode
from pagedkv.server.tools.request import template_tools
from pagedkv.server.unknown_fields import refuse_unknown_fields

ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorResponse} for status in (400, 401, 404, 413, 429, 503)
}
STREAMS: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {
        "description": "a message, or with `stream: true` Anthropic's server-sent events",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
}
ChatRender = Callable[
    [ChatCompletionRequest, Tenant, bool], Awaitable[tuple[ImagePrompt, ToolMode | None]]
]
PromptOnly = Callable[
    [ChatCompletionRequest, Tenant], Awaitable[tuple[ImagePrompt, ToolMode | None]]
]
StartGeneration = Callable[..., Awaitable[Generation]]
Explain = Callable[[ChatCompletionRequest, Tenant, SectionMap], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class MessagesContext:
    model_name: str
    check_open: Callable[[str | None], None]
    chat_render: ChatRender  # the prompt with its images' spans; the caller holds the share
    prompt_only: PromptOnly  # takes the share itself; refuses prompts past the context
    admit: Callable[[Tenant, int], ShareHeld]
    start_generation: StartGeneration  # (request, body, ids, tenant, arrived, held, tools)
    decode: Callable[[Sequence[int]], str]
    block_size: int | None
    explain: Explain  # `explain.Explainer.explain`: the answer of /v1/cache/explain
    render: Render  # the chat template (messages, tools) -> ids, for breakpoints' ends


def add_messages_routes(app: FastAPI, ctx: MessagesContext) -> None:
    @app.post("/v1/messages", tags=["anthropic"], responses=STREAMS)
    async def messages(request: Request, body: MessagesRequest, tenant: TenantDep) -> Response:
        arrived = time.perf_counter()
        ctx.check_open(body.model)
        refuse_unknown_fields(body, "/v1/messages", "an Anthropic Messages body")
        _check_thinking(body.thinking)
        points = breakpoints(body)
        held = ctx.admit(tenant, 1)
        with held.released_on_error():
            chat = to_chat_request(body)
            prompt, mode = await ctx.chat_render(chat, tenant, True)
            ids = prompt.token_ids
            leases = []
            if points and ctx.block_size:
                find = functools.partial(
                    lease_requests, points, ctx.render, chat_messages(chat),
                    template_tools(chat), chat_origins(body), ids, tenant.label,
                )  # fmt: skip
                leases = await to_thread.run_sync(find)
            gen = await ctx.start_generation(
                request, chat, ids, tenant, arrived, held, mode, leases=leases,
                images=prompt.images,
            )  # fmt: skip
        options = ReplyOptions(
            model=ctx.model_name,
            tools=mode,
            stop_sequences=tuple(body.stop_sequences or ()),
            decode=ctx.decode,
            block_size=ctx.block_size,
            prompt_tokens=len(ids),
            breakpoints=bool(points),
        )
        reply = AnthropicReply(gen, options)
        if not body.stream:
            return JSONResponse(await reply.body())
        return StreamingResponse(
            reply.sse(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/messages/count_tokens", tags=["anthropic"], responses=ERRORS)
    async def count_tokens(body: CountTokensRequest, tenant: TenantDep) -> Response:
        ctx.check_open(body.model)
        # The same body as /v1/messages may be sent: its generation fields cannot
        # change the count, so they are accepted; any other field is refused.
        refuse_unknown_fields(
            body,
            "/v1/messages/count_tokens",
            "an Anthropic count_tokens body",
            allow=MessagesRequest.model_fields.keys(),
        )
        prompt, _ = await ctx.prompt_only(to_chat_request(body), tenant)
        return JSONResponse({"input_tokens": len(prompt.token_ids)})

    @app.post("/v1/messages/explain", tags=["anthropic"], responses=ERRORS)
    async def explain(body: MessagesExplainRequest, tenant: TenantDep) -> Response:
        """What this Messages request would reuse from the cache if sent now, and why
        not more: the answer of POST /v1/cache/explain, for the prompt /v1/messages
        would render (top-level system and tools included). Never generates."""
        ctx.check_open(body.model)
        refuse_unknown_messages_fields(body)
        chat = to_chat_request(body)
        origins = chat_origins(body)
        roles = [m.role for m in body.messages]

        def sections(section: PromptSection | None) -> PromptSection | None:
            return section_in_messages(section, origins, roles)

        return JSONResponse(await ctx.explain(chat, tenant, sections))


def _check_thinking(thinking: ThinkingConfig | None) -> None:
    """Refuse extended thinking, which no model served here is run with; "disabled" is
    what every request gets, so it is honoured."""
    if thinking is not None and thinking.type != "disabled":
        raise bad_request(
            f"thinking.type {thinking.type!r} is not supported: extended thinking is not "
            "served; send {'type': 'disabled'} or leave thinking out",
            "thinking",
        )
