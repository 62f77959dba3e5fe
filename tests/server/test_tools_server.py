"""Tool calling on a real server subprocess whose tiny model's template renders tools."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_proc import ServerProc, running, start_server, tools_model_dir

pytestmark = pytest.mark.slow
__all__ = ["tools_model_dir"]  # a fixture, used by name

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city, in degrees Celsius",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
SHORT: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(tools_model_dir))


def test_tools_are_rendered_into_the_prompt(server: ServerProc) -> None:
    client = server.client()
    plain = client.chat.completions.create(messages=USER, **SHORT)
    with_tools = client.chat.completions.create(messages=USER, tools=[WEATHER], **SHORT)
    assert plain.usage and with_tools.usage
    # The definitions cost tokens: the template put them into the prompt.
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    # A random model writes no call: the reply is text, finished by length.
    assert with_tools.choices[0].finish_reason == "length"
    assert with_tools.choices[0].message.content


def test_a_tool_turn_reuses_the_cached_prefix_of_the_last_one(server: ServerProc) -> None:
    client = server.client()
    first = client.chat.completions.create(messages=USER, tools=[WEATHER], **SHORT)
    history: Any = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    second = client.chat.completions.create(messages=history, tools=[WEATHER], **SHORT)
    assert first.usage and second.usage and second.usage.prompt_tokens_details
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # Tool definitions and the user turn were cached by the first request (16-token blocks).
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def test_streaming_with_tools_and_required_choice(server: ServerProc) -> None:
    client = server.client()
    chunks = list(
        client.chat.completions.create(messages=USER, tools=[WEATHER], stream=True, **SHORT)
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    # "required" generates under the call format's grammar: a reply cut short by
    # max_tokens is the start of a call, returned as text, never a 500 (whole calls
    # are checked in test_structured_server.py).
    out = client.chat.completions.create(
        messages=USER, tools=[WEATHER], tool_choice="required", **SHORT
    )
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content is not None
    assert '<tool_call>\n{"name": "get_weather"'.startswith(out.choices[0].message.content)


def test_unknown_named_function_is_400(server: ServerProc) -> None:
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        server.client().chat.completions.create(
            messages=USER,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            **SHORT,
        )
