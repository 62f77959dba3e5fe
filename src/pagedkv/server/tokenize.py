"""`POST /tokenize` and `POST /detokenize`, in the shapes of vLLM's.

Tokenize takes text (`prompt`) or a conversation (`messages`, with `tools` and
`add_generation_prompt`) and answers the ids the model would see: a
conversation is rendered by the same code as `/v1/chat/completions`
(`chat_messages`, `template_tools`, `tool_mode`'s refusals, its images decoded and,
for a model that takes images, rendered by its processor with each image's
placeholder tokens), so `count` equals that route's `usage.prompt_tokens` for the
same messages. Detokenize answers
the text of ids, special tokens kept, as vLLM's does. Neither generates or
checks the prompt against the context: `max_model_len` is in the answer so the
client can.

Both are API routes like /v1: a key is needed when the server has keys
(`authn.TOKENIZER_PATHS`), the request limits walk their bodies
(`limits._LIMITED_PATHS`), and the tokenizer work takes one sequence of the
key's share and runs on the fair render pool, so a key tokenizing megabytes
waits on its own share and threads. A top-level field they do not define is
refused by name (vLLM's `continue_final_message`, `chat_template` and the like
included), rather than answering for a different prompt than the one meant.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagedkv.server.auth import Tenant
from pagedkv.server.authn import TenantDep
from pagedkv.server.chat_images import takes_images
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.http_errors import bad_request
from pagedkv.server.limits import ShareHeld
from pagedkv.server.prepare import chat_messages, check_token_ids
from pagedkv.server.protocol import (
    ERRORS,
    ChatCompletionRequest,
    ChatMessage,
    Text,
    TokenId,
    ToolDef,
    _Request,
)
from pagedkv.server.tools import ToolSupport
from pagedkv.server.tools.request import template_tools, tool_mode
from pagedkv.server.unknown_fields import refuse_unknown_fields

_TOKENIZE_FIELDS = (
    "model, prompt or messages, add_special_tokens, add_generation_prompt, tools and "
    "return_token_strs"
)
# `_blocking` of server/app.py on the render pool: (fn, arg, *, what, owner) -> list.
Blocking = Callable[..., Awaitable[list[Any]]]


class TokenizeRequest(_Request):
    """One of `prompt` or `messages`. Top-level fields not defined here are kept in
    `model_extra` only to be refused by name."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: Text | None = Field(None, description="text to tokenize; or send messages")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="a conversation, rendered by the chat template"
    )
    add_special_tokens: bool | None = Field(
        None,
        description="prompt: add the tokenizer's special tokens such as a BOS (default "
        "true); messages: only false, the template places them",
    )
    add_generation_prompt: bool = Field(
        True, description="messages only: end with the start of the assistant's reply"
    )
    tools: list[ToolDef] | None = Field(
        None, max_length=512, description="messages only: rendered as the chat route does"
    )
    return_token_strs: bool | None = Field(
        False, description="also answer each id's string in the vocabulary"
    )


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


@dataclass(frozen=True)
class TokenizerContext:
    engine: EngineAPI
    tools: ToolSupport
    check_open: Callable[[str | None], None]
    admit: Callable[[Tenant, int], ShareHeld]
    blocking: Blocking
    # Decodes the request's images onto their parts (`app.check_images`): a model that
    # takes images counts each image's placeholder tokens as the chat route does.
    attach_images: Callable[[ChatCompletionRequest, Tenant], Awaitable[None]]


def add_tokenizer_routes(app: FastAPI, ctx: TokenizerContext) -> None:
    engine = ctx.engine
    vocab_size = engine.vocab_size if engine.vocab_size > 0 else None

    @app.post("/tokenize", tags=["tokenizer"], response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest, tenant: TenantDep) -> Response:
        ctx.check_open(body.model)
        refuse_unknown_fields(body, "/tokenize", _TOKENIZE_FIELDS)
        with ctx.admit(tenant, 1):
            if body.messages is not None:
                ids = await conversation_ids(body, tenant)
            else:
                ids = await text_ids(body, tenant)
            strs = None
            if body.return_token_strs:
                strs = await ctx.blocking(
                    engine.token_strings, ids, what="the tokenizer", owner=tenant.salt
                )
        answer = {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}
        return JSONResponse({**answer, "token_strs": strs})

    async def text_ids(body: TokenizeRequest, tenant: Tenant) -> list[int]:
        if body.prompt is None:
            raise bad_request(
                "send 'prompt' (text) or 'messages' (a conversation) to tokenize", "prompt"
            )
        for name in ("add_generation_prompt", "tools"):
            if name in body.model_fields_set:
                raise bad_request(f"{name} applies to 'messages' only, not to 'prompt'", name)
        fn = engine.encode_continuation if body.add_special_tokens is False else engine.tokenize
        return await ctx.blocking(fn, body.prompt, what="the tokenizer", owner=tenant.salt)

    async def conversation_ids(body: TokenizeRequest, tenant: Tenant) -> list[int]:
        if body.prompt is not None:
            raise bad_request("send either 'prompt' or 'messages', not both", "prompt")
        if body.add_special_tokens:
            raise bad_request(
                "add_special_tokens applies to 'prompt' only: the chat template places the "
                "model's special tokens itself; leave it out or send false",
                "add_special_tokens",
            )
        # The chat route's own steps, so the ids (and refusals) are that route's.
        chat = ChatCompletionRequest.model_construct(messages=body.messages, tools=body.tools)
        tool_mode(chat, ctx.tools)  # refuses tools the model's template cannot take
        await ctx.attach_images(chat, tenant)
        tools, generation = template_tools(chat), body.add_generation_prompt
        render: Callable[[list[dict[str, Any]]], list[int]]
        if takes_images(engine):

            def render(messages: list[dict[str, Any]]) -> list[int]:
                vlm: Any = engine  # `Engine.render_chat`; a text-only double has none
                prompt = vlm.render_chat(messages, tools, add_generation_prompt=generation)
                return prompt.token_ids

        else:
            render = functools.partial(
                engine.apply_chat_template, tools=tools, add_generation_prompt=generation
            )
        return await ctx.blocking(
            render, chat_messages(chat), what="the chat template", owner=tenant.salt
        )

    @app.post(
        "/detokenize", tags=["tokenizer"], response_model=DetokenizeResponse, responses=ERRORS
    )
    async def detokenize(body: DetokenizeRequest, tenant: TenantDep) -> Response:
        ctx.check_open(body.model)
        refuse_unknown_fields(body, "/detokenize", "model and tokens")
        check_token_ids(body.tokens, vocab_size, "tokens")
        with ctx.admit(tenant, 1):
            texts = await ctx.blocking(
                decode_keeping_special_tokens, body.tokens, what="the tokenizer", owner=tenant.salt
            )
        return JSONResponse({"prompt": texts[0]})

    def decode_keeping_special_tokens(ids: Sequence[int]) -> list[str]:
        return [engine.decode(ids, skip_special_tokens=False)]  # a list: what `Blocking` returns
