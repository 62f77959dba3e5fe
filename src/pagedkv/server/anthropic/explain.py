"""`POST /v1/messages/explain`: explain for an Anthropic Messages body.

The body is converted as `/v1/messages` converts it (`convert.to_chat_request`),
so the prompt explained is the one that route renders and caches: top-level
`system` and `tools` included. Its fields follow `server/explain.py`'s rule:
every field of a Messages request is accepted (the generation-only ones, such as
`max_tokens`, which is optional here, cannot change the prompt); any other
top-level field is refused by name.

The miss's section is named in the caller's terms: `message_index` counts the
body's `messages` (the chat form puts the system prompt first and splits a user
turn's tool results into messages of their own), and a miss in the top-level
system prompt is kind "system" with no index.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ConfigDict, Field

from pagedkv.server.anthropic.protocol import MessagesRequest
from pagedkv.server.sections import PromptSection
from pagedkv.server.unknown_fields import refuse_unknown_fields


class MessagesExplainRequest(MessagesRequest):
    """A Messages body whose `max_tokens` may be left out; unknown top-level fields
    are kept in `model_extra` only to be refused by name."""

    model_config = ConfigDict(extra="allow")

    # Optional: it cannot change the prompt, and a client asking "would this hit?"
    # should not have to invent it. `to_chat_request`, the one reader, passes None on
    # as the chat form's "not given".
    max_tokens: int | None = Field(None, ge=1)  # type: ignore[assignment]


# Fields of the other API's body, and where that body goes instead.
_OPENAI_ONLY = frozenset(
    {"n", "response_format", "max_completion_tokens", "logprobs", "seed", "stop", "user"}
)


def refuse_unknown_messages_fields(body: MessagesExplainRequest) -> None:
    hint = ""
    if _OPENAI_ONLY & (body.model_extra or {}).keys():
        hint = "An OpenAI chat completion body goes to POST /v1/cache/explain."
    refuse_unknown_fields(body, "/v1/messages/explain", "an Anthropic Messages body", hint)


def section_in_messages(
    section: PromptSection | None, origins: Sequence[int | None], roles: Sequence[str]
) -> PromptSection | None:
    """`section` of the chat form, renamed for the Anthropic body whose chat messages
    came from `origins` (`convert.chat_origins`) and whose messages have `roles`."""
    if section is None or section.message_index is None:
        return section
    if not 0 <= section.message_index < len(origins):
        return None
    origin = origins[section.message_index]
    if origin is None:
        return PromptSection("system", None, "system")
    return PromptSection("message", origin, roles[origin])
