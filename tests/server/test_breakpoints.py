"""Anthropic cache_control breakpoints: where each one ends in the prompt, and the
breakpoints that are refused (a fake template: one token per character)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pagedkv.server.anthropic.breakpoints import breakpoints, lease_requests
from pagedkv.server.anthropic.convert import chat_origins, to_chat_request
from pagedkv.server.anthropic.protocol import MessagesRequest
from pagedkv.server.http_errors import APIError
from pagedkv.server.prepare import chat_messages

EPH = {"type": "ephemeral"}


def render(messages: Sequence[dict[str, Any]], tools: Any = None) -> list[int]:
    text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"
    return [ord(c) for c in text]


def body(**kw: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 1, **kw})


def test_each_breakpoint_leases_up_to_the_end_of_its_section() -> None:
    req = body(
        system=[{"type": "text", "text": "sys", "cache_control": EPH}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "u0", "cache_control": EPH}]},
            {"role": "assistant", "content": "a1"},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": [
                        {"type": "text", "text": "r", "cache_control": {**EPH, "ttl": "1h"}},
                    ]},
                    {"type": "text", "text": "u2"},
                ],
            },
        ],
    )  # fmt: skip
    points = breakpoints(req)
    assert [(p.kind, p.index, p.ttl_s) for p in points] == [
        ("system", None, 300.0), ("message", 0, 300.0), ("message", 2, 3600.0),
    ]  # fmt: skip
    chat = to_chat_request(req)
    messages = chat_messages(chat)
    prompt = render(messages)
    got = lease_requests(points, render, messages, None, chat_origins(req), prompt, "key1")
    text = "".join(chr(t) for t in prompt)
    ends = [text[: lease.num_tokens] for lease in got]
    # A section ends where the next one starts to differ: the header the next
    # message shares with the generation prompt counts to it, as in explain.
    assert ends[0] in ("<system>sys</>", "<system>sys</><")
    assert ends[1] == "<system>sys</><user>u0</><assistant>"  # the next turn: assistant
    assert ends[2] == text  # the last message: the whole prompt
    assert {lease.label for lease in got} == {"key1"}


def test_more_than_four_breakpoints_are_refused_by_name() -> None:
    blocks = [{"type": "text", "text": str(i), "cache_control": EPH} for i in range(5)]
    with pytest.raises(APIError) as err:
        breakpoints(body(messages=[{"role": "user", "content": blocks}]))
    assert err.value.param == "cache_control"
