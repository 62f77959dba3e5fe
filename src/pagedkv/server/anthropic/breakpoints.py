"""Anthropic `cache_control` breakpoints: checked, then turned into leases.

A breakpoint on a content block (of `tools`, `system` or a message) leases the
prompt up to the end of that block for its `ttl` ("5m" by default, or "1h"),
renewed by every request that hits it (`pagedkv.cache.leases`). The end is taken
at the end of the section holding the block, located by rendering the template
again (`server/sections.py`): the end of the tool definitions, of the system
prompt, or of the message (its last chat message, where a user turn's tool
results became several). A breakpoint on a block that is not its message's last
therefore leases the rest of that message too: the template, not the client,
lays out a message's blocks, so their ends are not known one by one. Only whole
blocks of `block_size` tokens are leased.

At most `MAX_BREAKPOINTS` breakpoints, as Anthropic allows; a `type` other than
"ephemeral", a `ttl` other than "5m" or "1h", or another field is a 400 naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pagedkv.cache.leases import TTL_SECONDS, LeaseRequest
from pagedkv.server.anthropic.protocol import ContentBlock, MessagesRequest
from pagedkv.server.http_errors import bad_request
from pagedkv.server.sections import Render, end_of_messages, tools_end

MAX_BREAKPOINTS = 4
_TTLS = ("5m", "1h")


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """Where a breakpoint is: after the tools, the system prompt or message `index`."""

    kind: Literal["tools", "system", "message"]
    index: int | None
    ttl_s: float


def _ttl_of(control: dict[str, Any], param: str) -> float:
    extra = sorted(set(control) - {"type", "ttl"})
    if extra:
        raise bad_request(
            f"{param}.{extra[0]}: cache_control takes only 'type' and 'ttl'", f"{param}.{extra[0]}"
        )
    if control.get("type") != "ephemeral":
        raise bad_request(
            f"{param}.type must be 'ephemeral', got {control.get('type')!r}", f"{param}.type"
        )
    ttl = control.get("ttl", "5m")
    if ttl not in _TTLS:
        raise bad_request(f"{param}.ttl must be '5m' or '1h', got {ttl!r}", f"{param}.ttl")
    return TTL_SECONDS[ttl]


def _in_blocks(
    blocks: Sequence[ContentBlock],
    param: str,
    kind: Literal["system", "message"],
    index: int | None,
) -> list[Breakpoint]:
    out: list[Breakpoint] = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        if block.cache_control is not None:
            out.append(
                Breakpoint(kind, index, _ttl_of(block.cache_control, where + ".cache_control"))
            )
        if isinstance(block.content, list):  # a tool_result's own blocks
            out += _in_blocks(block.content, where + ".content", kind, index)
    return out


def breakpoints(body: MessagesRequest) -> list[Breakpoint]:
    """Every breakpoint of `body`, checked; a 400 naming the first bad one."""
    out: list[Breakpoint] = []
    for j, tool in enumerate(body.tools or ()):
        if tool.cache_control is not None:
            ttl = _ttl_of(tool.cache_control, f"tools[{j}].cache_control")
            out.append(Breakpoint("tools", None, ttl))
    if isinstance(body.system, list):
        out += _in_blocks(body.system, "system", "system", None)
    for i, msg in enumerate(body.messages):
        if isinstance(msg.content, list):
            out += _in_blocks(msg.content, f"messages[{i}].content", "message", i)
    if len(out) > MAX_BREAKPOINTS:
        raise bad_request(
            f"cache_control: {len(out)} breakpoints, at most {MAX_BREAKPOINTS} are allowed",
            "cache_control",
        )
    return out


def lease_requests(
    points: Sequence[Breakpoint],
    render: Render,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    origins: Sequence[int | None],
    prompt: Sequence[int],
    label: str,
) -> list[LeaseRequest]:
    """The leases of `points` over `prompt` (the render of `messages` and `tools`, whose
    chat message c came from `origins[c]` of the request's messages, None: the system
    prompt). Blocking (template renders): run it on a thread. A breakpoint whose end
    cannot be located leases nothing."""
    out: list[LeaseRequest] = []
    for point in points:
        end: int | None
        if point.kind == "tools":
            end = tools_end(render, messages, prompt) if tools else None
        elif point.kind == "system":
            end = end_of_messages(render, messages, tools, prompt, 1)
        else:
            chats = [c for c, o in enumerate(origins) if o == point.index]
            end = end_of_messages(render, messages, tools, prompt, chats[-1] + 1) if chats else None
        if end:
            out.append(LeaseRequest(end, point.ttl_s, False, label))
    return out
