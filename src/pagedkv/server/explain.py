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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from anyio import to_thread
from pydantic import ConfigDict

from pagedkv.model.vision import ImagePrompt
from pagedkv.server.auth import Tenant
from pagedkv.server.drift import STRIDE, RenderMemory
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.http_errors import bad_request
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.prepare import chat_messages
from pagedkv.server.protocol import ChatCompletionRequest
from pagedkv.server.render_pool import RenderPool
from pagedkv.server.sections import PromptSection, message_end, request_section
from pagedkv.server.tools.output import ToolMode
from pagedkv.server.tools.request import template_tools
from pagedkv.server.unknown_fields import refuse_unknown_fields

PromptOnly = Callable[
    [ChatCompletionRequest, Tenant], Awaitable[tuple[ImagePrompt, ToolMode | None]]
]
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
    (the answer is "new" for them) except to an admin key, which is told
    `other_tenant` when another key's salt holds the prefix (`other_salts`: every
    other key's salt; never which one). The answer holds positions, reasons and this
    request's own text only (docs/security.md, "What explain shows to whom"), and the
    miss's section is found in this request's messages, named by `sections`.

    A new or diverged miss inside messages that this salt sent before in the same
    order, which rendered to other tokens then, is `template_drift` (`drift`, fed by
    the generating routes). Each miss is counted in `metrics` by its reason."""

    engine: EngineAPI
    prompt_only: PromptOnly
    render: RenderPool
    # Told of every miss explained (the dashboard's list of misses); None: nobody.
    on_miss: Callable[[Tenant, dict[str, Any]], None] | None = None
    metrics: ServerMetrics | None = None
    other_salts: Callable[[Tenant], Sequence[str]] | None = None
    drift: RenderMemory | None = None
    # Which LoRA adapter a request's `model` names (`server.adapters.ModelNames`).
    adapter_of: Callable[[str | None], str | None] | None = None

    async def explain(
        self,
        body: ChatCompletionRequest,
        tenant: Tenant,
        sections: SectionMap | None = None,
    ) -> dict[str, Any]:
        lora = self.adapter_of(body.model) if self.adapter_of is not None else None
        prompt, _ = await self.prompt_only(body, tenant)
        ids = prompt.token_ids
        salt = tenant.cache_salt(body.cache_salt)
        others: Sequence[str] = ()
        if tenant.is_admin and self.other_salts is not None:
            others = self.other_salts(tenant)
        try:
            answer = await to_thread.run_sync(
                functools.partial(
                    self.engine.explain,
                    ids,
                    cache_salt=salt,
                    other_salts=others,
                    lora=lora,
                    images=prompt.images,
                )
            )
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
        out = answer.to_json()
        if answer.miss is not None:
            index = answer.miss.token_index
            where = functools.partial(request_section, self.engine, body, ids)
            section = await self.render.run(tenant.salt, where, index)
            if answer.miss.reason in ("new", "diverged") and section is not None:
                drifted = await self._drift(body, ids, salt, section, index, tenant)
                if drifted is not None:
                    out["miss"].update(reason="template_drift", detail=drifted)
            if sections is not None:
                section = sections(section)
            out["miss"]["section"] = section.to_json() if section is not None else None
            if self.on_miss is not None:
                self.on_miss(tenant, out)
            if self.metrics is not None:
                self.metrics.observe_explain(out["miss"]["reason"])
        return out

    def remember(self, body: ChatCompletionRequest, tenant: Tenant, ids: Sequence[int]) -> None:
        """A generating request's render, for `template_drift` (blocking: the render
        pool's thread)."""
        if self.drift is not None:
            salt = tenant.cache_salt(body.cache_salt)
            self.drift.remember(salt, chat_messages(body), template_tools(body), ids)

    async def _drift(
        self,
        body: ChatCompletionRequest,
        ids: list[int],
        salt: str | None,
        section: PromptSection,
        index: int,
        tenant: Tenant,
    ) -> str | None:
        memory, k = self.drift, section.message_index
        if memory is None or k is None:
            return None

        def find() -> str | None:
            assert memory is not None and k is not None
            end = message_end(self.engine, body, ids, k)
            if end is None or end <= index:
                return None
            found = memory.drift(
                salt, chat_messages(body), template_tools(body), ids, k, end, index
            )
            if found is None:
                return None
            return (
                f"this key sent the same messages up to message {k} before, and the chat "
                f"template rendered them to other tokens then: they part within tokens "
                f"{found.start}-{found.start + STRIDE - 1} (the template prints something "
                "that changes, such as a date, or it changed): no cache can reuse a "
                "prompt whose tokens changed"
            )

        return await self.render.run(tenant.salt, find)
