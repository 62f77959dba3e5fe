"""Which part of a chat prompt a token position falls in: the tool definitions, the
system prompt, or message k.

Explain names the section of its first recomputed token from the caller's own
request, never from a cached one: the position is the only thing taken from the
lookup (docs/security.md, "What explain shows to whom").

The chat template owns the layout, so the section is found by rendering it again,
not by parsing its output: message k-1 ends where the prompt of `messages[:k]`
stops agreeing with the whole prompt (`_boundary`), and the first k whose boundary
passes the position is found by galloping outward from a guess (`_guess`: tokens
taken as proportional to each message's characters), then bisecting: usually one
or two renders (the guess and its neighbour; a miss in the system prompt, the
common case, renders only the first messages), and at most
2*log2(len(messages)) + 1 for any miss (+1 for the tools). Rejected: locating each
message's text in the rendered string, which breaks on templates that trim,
escape or drop content, and needs character offsets the engine's API does not
give.

Best effort by design: a message's header tokens (`<|im_start|>`) may count to
the message before it, the generation prompt after the last message counts to
that message, and a template that changes earlier turns as later ones arrive
(some strip the reasoning of older assistant turns) can shift a boundary. When
the template refuses a prefix (some require a user turn), the prefix is tried
again followed by an empty user turn; if that fails too the section is unknown.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pagedkv.engine.reasoning import common_prefix
from pagedkv.server.chat_images import template_ids
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.prepare import chat_messages
from pagedkv.server.protocol import ChatCompletionRequest
from pagedkv.server.tools.request import template_tools

log = logging.getLogger(__name__)

Kind = Literal["system", "tools", "message"]
# Messages (and tools) to the template's token ids, generation prompt included.
Render = Callable[[Sequence[dict[str, Any]], Sequence[dict[str, Any]] | None], list[int]]


@dataclass(frozen=True, slots=True)
class PromptSection:
    """`message_index` and `role` are set for "system" and "message" (the index is
    the position in the request's `messages`); "tools" is where the template put
    the tool definitions."""

    kind: Kind
    message_index: int | None = None
    role: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "message_index": self.message_index, "role": self.role}


def _render(render: Render, messages: Sequence[dict[str, Any]], tools: Any) -> list[int] | None:
    # The template is the model's code, and refusing a prefix the request never
    # sends is not the client's error: any exception means "unknown here".
    try:
        return list(render(messages, tools))
    except Exception as exc:
        log.debug("explain: the chat template refused a prefix of the messages: %r", exc)
        return None


def _boundary(
    render: Render, messages: Sequence[dict[str, Any]], tools: Any, prompt: Sequence[int], k: int
) -> int | None:
    """Where message k-1 ends in `prompt`: its agreement with the prompt of messages[:k]."""
    ids = _render(render, messages[:k], tools)
    if ids is None:
        ids = _render(render, [*messages[:k], {"role": "user", "content": ""}], tools)
    return None if ids is None else common_prefix(ids, prompt)


def _tools_span(
    render: Render, messages: Sequence[dict[str, Any]], prompt: Sequence[int]
) -> tuple[int, int] | None:
    """From the first to the last token where `prompt` differs from the same messages
    rendered without tools."""
    bare = _render(render, messages, None)
    if bare is None:
        return None
    start = common_prefix(bare, prompt)
    tail = common_prefix(bare[start:][::-1], list(prompt[start:])[::-1])
    return start, len(prompt) - tail


def _guess(messages: Sequence[dict[str, Any]], tools: Any, index: int, num_template: int) -> int:
    """The k whose messages[:k] probably end at or before token `index`, taking tokens
    as proportional to the characters of each message's JSON (tools counted first)."""
    sizes = [len(json.dumps(m, default=str)) for m in messages]
    ends = np.cumsum(sizes) + (len(json.dumps(tools, default=str)) if tools else 0)
    target = index / num_template * float(ends[-1])
    return min(int(np.searchsorted(ends, target, side="right")), len(messages) - 1)


def locate_section(
    render: Render,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    prompt: Sequence[int],
    num_template: int,
    index: int,
) -> PromptSection | None:
    """The section of `prompt` (whose first `num_template` tokens are the template's
    render of `messages` and `tools`) holding token `index`; None when unknown."""
    if index >= num_template or not messages:
        return None
    template = prompt[:num_template]
    if tools:
        span = _tools_span(render, messages, template)
        if span is not None and span[0] <= index < span[1]:
            return PromptSection("tools")
    n = len(messages)

    def boundary(k: int) -> int | None:
        if k == 0:
            return 0
        return num_template if k == n else _boundary(render, messages, tools, template, k)

    # Find lo < hi with boundary(lo) <= index < boundary(hi) by galloping outward
    # from a guess, then bisect.
    k = _guess(messages, tools, index, num_template)
    end = boundary(k)
    if end is None:
        return None
    lo, hi, step = 0, n, 1
    if end <= index:
        lo = k
        while k + step < n:
            end = boundary(k + step)
            if end is None:
                return None
            if end > index:
                hi = k + step
                break
            lo, step = k + step, 2 * step
    else:
        hi = k
        while k - step > 0:
            end = boundary(k - step)
            if end is None:
                return None
            if end <= index:
                lo = k - step
                break
            hi, step = k - step, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        end = boundary(mid)
        if end is None:
            return None
        lo, hi = (lo, mid) if end > index else (mid, hi)
    role = str(messages[hi - 1].get("role"))
    return PromptSection("system" if role == "system" else "message", hi - 1, role)


def request_section(
    engine: EngineAPI,
    body: ChatCompletionRequest,
    prompt: list[int],
    index: int,
) -> PromptSection | None:
    """`locate_section` for a chat request whose prompt the route built; blocking
    (template renders): run it on a thread."""
    messages, tools = chat_messages(body), template_tools(body)
    return locate_section(template_ids(engine), messages, tools, prompt, len(prompt), index)


def message_end(
    engine: EngineAPI, body: ChatCompletionRequest, prompt: list[int], message_index: int
) -> int | None:
    """Where message `message_index` of a chat request ends in its prompt (the render of
    the messages up to it, compared with the prompt); blocking: run it on a thread."""
    messages, tools = chat_messages(body), template_tools(body)
    return end_of_messages(template_ids(engine), messages, tools, prompt, message_index + 1)


def end_of_messages(
    render: Render, messages: Sequence[dict[str, Any]], tools: Any, prompt: Sequence[int], k: int
) -> int | None:
    """Where message k-1 ends in `prompt` (the template's render of all `messages`):
    the end of the prompt for the last message; None when unknown."""
    return len(prompt) if k >= len(messages) else _boundary(render, messages, tools, prompt, k)


def tools_end(
    render: Render, messages: Sequence[dict[str, Any]], prompt: Sequence[int]
) -> int | None:
    """Where the tool definitions end in `prompt`; None when unknown."""
    span = _tools_span(render, messages, prompt)
    return None if span is None else span[1]
