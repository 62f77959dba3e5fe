"""`POST /v1/cache/explain`'s body and the answer both explain routes give.

Explain answers for one exact prompt, so a field it cannot use must not be
dropped: a dropped Anthropic top-level `system` used to make it explain a
different prompt from the one the client meant, and say so with confidence.
The rule, for `/v1/cache/explain` here and `/v1/messages/explain`
(`anthropic/explain.py`): every field of the route's generating request is
accepted (the fields that shape the prompt are used; the generation-only
ones, `max_tokens`, `temperature`, `stream` and the like, cannot change it and
are accepted so that the same body can be sent to both routes); any other
top-level field is refused with a 400 naming it. Fields inside messages follow
the generating route: what it ignores cannot change its prompt either.
The refusal is `unknown_fields.refuse_unknown_fields`.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from anyio import to_thread
from pydantic import ConfigDict

from pagedkv.server.auth import Tenant
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.http_errors import bad_request
from pagedkv.server.protocol import ChatCompletionRequest
from pagedkv.server.render_pool import RenderPool
from pagedkv.server.sections import PromptSection, request_section
from pagedkv.server.tools.output import ToolMode
from pagedkv.server.unknown_fields import refuse_unknown_fields

PromptOnly = Callable[[ChatCompletionRequest, Tenant], Awaitable[tuple[list[int], ToolMode | None]]]
# A section of the chat form's prompt as the caller's own API names it.
SectionMap = Callable[[PromptSection | None], PromptSection | None]

# Fields of the other API's body, and where that body goes instead.
_ANTHROPIC_ONLY = frozenset({"system", "stop_sequences", "metadata", "thinking"})


class ChatExplainRequest(ChatCompletionRequest):
    """A chat completion body; top-level fields it does not define are kept in
    `model_extra` only to be refused by name (`refuse_unknown_fields`)."""

    model_config = ConfigDict(extra="allow")


def refuse_unknown_chat_fields(body: ChatExplainRequest) -> None:
    extra = body.model_extra or {}
    hint = ""
    if _ANTHROPIC_ONLY & extra.keys():
        hint = "An Anthropic Messages body goes to POST /v1/messages/explain."
    refuse_unknown_fields(body, "/v1/cache/explain", "an OpenAI chat completion body", hint)


@dataclass(frozen=True)
class Explainer:
    """What a chat request would reuse from the cache if sent now, and why not more:
    the prompt is rendered under one sequence of the key's share (`prompt_only`),
    hashed and looked up; nothing is generated. Another key's prompts are invisible
    (the answer is "new" for them); the answer holds positions, reasons and this
    request's own text only (docs/security.md, "What explain shows to whom"), and the
    miss's section is found in this request's messages, named by `sections`."""

    engine: EngineAPI
    prompt_only: PromptOnly
    render: RenderPool
    # Which LoRA adapter a request's `model` names (`server.adapters.ModelNames`).
    adapter_of: Callable[[str | None], str | None] | None = None

    async def explain(
        self,
        body: ChatCompletionRequest,
        tenant: Tenant,
        sections: SectionMap | None = None,
    ) -> dict[str, Any]:
        lora = self.adapter_of(body.model) if self.adapter_of is not None else None
        ids, _ = await self.prompt_only(body, tenant)
        salt = tenant.cache_salt(body.cache_salt)
        try:
            answer = await to_thread.run_sync(
                functools.partial(self.engine.explain, ids, cache_salt=salt, lora=lora)
            )
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        out = answer.to_json()
        if answer.miss is not None:
            where = functools.partial(request_section, self.engine, body, ids)
            section = await self.render.run(tenant.salt, where, answer.miss.token_index)
            if sections is not None:
                section = sections(section)
            out["miss"]["section"] = section.to_json() if section is not None else None
        return out
