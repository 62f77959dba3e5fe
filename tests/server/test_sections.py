"""`locate_section` on a real tokenizer and chat templates: the part of the caller's own
prompt where two prompts first differ (tools, system prompt, message k), with
templates that refuse prefixes, in a bounded number of renders."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from fixtures_models import TINY_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, make_tiny_tokenizer

from pagedkv.server.sections import PromptSection, locate_section

Messages = list[dict[str, Any]]
# Like Qwen3's: no render without a user turn (a system prompt alone is refused).
NEEDS_USER = (
    "{% if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
    "{{ raise_exception('No user query found in messages.') }}{% endif %}" + TINY_CHAT_TEMPLATE
)
WEATHER = {
    "type": "function",
    "function": {"name": "weather", "description": "Weather in a city", "parameters": {}},
}


class Renderer:
    """The tokenizer's template as the engine renders it; counts the renders."""

    def __init__(self, template: str) -> None:
        self.tok = make_tiny_tokenizer(chat_template=template)
        self.calls = 0

    def __call__(self, messages: Sequence[dict[str, Any]], tools: Any = None) -> list[int]:
        self.calls += 1
        kw = {"tools": list(tools)} if tools else {}
        ids = self.tok.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False, **kw
        )
        return [int(t) for t in ids]


def chat(n: int, system: str = "You are a helpful assistant. Today is 2024-05-01.") -> Messages:
    out: Messages = [{"role": "system", "content": system}]
    for i in range(1, n):
        role = "user" if i % 2 else "assistant"
        out.append({"role": role, "content": f"turn {i}: something about caches and blocks"})
    return out


def where(
    render: Renderer,
    earlier: Messages,
    ours: Messages,
    tools: Any = None,
    earlier_tools: Any = None,
) -> PromptSection | None:
    """The section of `ours` at its first token that differs from `earlier`'s prompt."""
    theirs = render(earlier, earlier_tools if earlier_tools is not None else tools)
    prompt = render(ours, tools)
    index = next(i for i, (a, b) in enumerate(zip(theirs, prompt, strict=False)) if a != b)
    render.calls = 0
    return locate_section(render, ours, tools, prompt, len(prompt), index)


@pytest.mark.parametrize("template", [TINY_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, NEEDS_USER])
def test_a_changed_system_prompt_is_the_system_section(template: str) -> None:
    render = Renderer(template)
    ours = chat(6, system="You are a helpful assistant. Today is 2024-05-02.")
    assert where(render, chat(6), ours) == PromptSection("system", 0, "system")


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_a_change_inside_message_k_names_message_k(k: int) -> None:
    render = Renderer(TOOLS_CHAT_TEMPLATE)
    ours = chat(6)
    ours[k] = {**ours[k], "content": ours[k]["content"].replace("blocks", "hashes")}
    role = ours[k]["role"]
    assert where(render, chat(6), ours) == PromptSection("message", k, role)
    assert where(render, chat(6), ours, tools=[WEATHER]) == PromptSection("message", k, role)


def test_an_added_or_changed_role_is_the_message_it_starts() -> None:
    render = Renderer(TOOLS_CHAT_TEMPLATE)
    earlier, ours = chat(4), chat(4)
    ours[2] = {"role": "user", "content": ours[2]["content"]}  # was assistant
    assert where(render, earlier, ours) == PromptSection("message", 2, "user")
    # A user message without a system prompt: message 0 is a plain message.
    assert where(render, earlier[1:], ours[1:]) == PromptSection("message", 1, "user")


def test_changed_tool_definitions_are_the_tools_section() -> None:
    render = Renderer(TOOLS_CHAT_TEMPLATE)
    renamed = {**WEATHER, "function": {**WEATHER["function"], "description": "Forecast"}}
    found = where(render, chat(4), chat(4), tools=[renamed], earlier_tools=[WEATHER])
    assert found == PromptSection("tools")


def test_one_or_two_renders_for_even_turns_and_logarithmic_for_any() -> None:
    render = Renderer(TINY_CHAT_TEMPLATE)
    even, skewed = chat(128), chat(128)
    skewed[1] = {**skewed[1], "content": "a long document " * 400}  # the guess is far off
    for earlier in (even, skewed):
        calls = {}
        for k in (0, 1, 40, 100, 126, 127):
            ours = [*earlier[:k], {**earlier[k], "content": "changed"}, *earlier[k + 1 :]]
            want = PromptSection("system" if k == 0 else "message", k, ours[k]["role"])
            assert where(render, earlier, ours) == want
            calls[k] = render.calls
        assert max(calls.values()) <= 2 * 7 + 1, calls  # 2 * log2(128) + 1
        if earlier is even:  # tokens follow characters: the guess or its neighbour
            assert max(calls.values()) <= 2, calls


def test_a_template_that_refuses_every_prefix_gives_no_section() -> None:
    render = Renderer(TINY_CHAT_TEMPLATE)
    ours = chat(4)
    prompt = render(ours)

    def refuses_prefixes(messages: Sequence[dict[str, Any]], tools: Any = None) -> list[int]:
        if len(messages) != len(ours) or messages[-1] != ours[-1]:
            raise ValueError("this template renders only whole conversations")
        return render(messages, tools)

    assert locate_section(refuses_prefixes, ours, None, prompt, len(prompt), 3) is None
