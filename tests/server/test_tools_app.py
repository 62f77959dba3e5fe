"""Tool calling through the app, over a fake engine whose reply is scripted: a random
tiny model cannot be made to write a tool call, so the parsing, the finish reason and
the streamed deltas are driven here with exact replies, through the official client."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from server_fake_engine import FakeEngine
from starlette.testclient import TestClient

from pagedkv.server.app import create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = [{"role": "user", "content": "weather in Paris?"}]


def client_for(engine: FakeEngine, **kwargs: Any) -> openai.OpenAI:
    http = TestClient(create_app(engine, **kwargs), raise_server_exceptions=False)
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0
    )


def test_a_call_comes_back_as_tool_calls_with_finish_reason_tool_calls() -> None:
    engine = FakeEngine(max_context=4096, reply="Checking.\n" + CALL)
    out = client_for(engine).chat.completions.create(
        model="fake-model", messages=USER, tools=[WEATHER]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The tools were rendered into the prompt by the template.
    prompt = engine.decode(engine.calls[-1]["ids"])
    assert '"name": "get_weather"' in prompt and "The weather in a city" in prompt


def test_streamed_calls_are_reassembled_by_the_openai_client() -> None:
    reply = "Two calls: " + CALL + CALL.replace("Paris", "Oslo")
    client = client_for(FakeEngine(max_context=4096, reply=reply))
    with client.chat.completions.stream(
        model="fake-model", messages=USER, tools=[WEATHER]
    ) as stream:
        contents = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert "".join(contents) == "Two calls: " == choice.message.content
    calls = choice.message.tool_calls or []
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Oslo"]
    assert len({c.id for c in calls}) == 2


def test_parallel_tool_calls_false_returns_the_first_call_only() -> None:
    client = client_for(FakeEngine(max_context=4096, reply=CALL + CALL.replace("Paris", "Oslo")))
    for stream in (False, True):
        raw = client.chat.completions.create(
            model="fake-model",
            messages=USER,
            tools=[WEATHER],
            parallel_tool_calls=False,
            stream=stream,
        )
        if stream:
            args = "".join(
                tc.function.arguments or ""
                for chunk in raw  # type: ignore[union-attr]
                for tc in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])
                if tc.function
            )
        else:
            args = raw.choices[0].message.tool_calls[0].function.arguments  # type: ignore[union-attr,index]
            assert len(raw.choices[0].message.tool_calls or []) == 1  # type: ignore[union-attr]
        assert json.loads(args) == {"city": "Paris"}


def test_malformed_call_is_plain_text_never_an_error() -> None:
    broken = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    client = client_for(FakeEngine(max_context=4096, reply=broken))
    out = client.chat.completions.create(model="fake-model", messages=USER, tools=[WEATHER])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == broken and not out.choices[0].message.tool_calls
    chunks = list(
        client.chat.completions.create(
            model="fake-model", messages=USER, tools=[WEATHER], stream=True
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == broken and chunks[-1].choices[0].finish_reason == "stop"


def test_tool_choice_none_renders_tools_but_parses_nothing() -> None:
    engine = FakeEngine(max_context=4096, reply=CALL)
    out = client_for(engine).chat.completions.create(
        model="fake-model", messages=USER, tools=[WEATHER], tool_choice="none"
    )
    assert out.choices[0].message.content == CALL and out.choices[0].finish_reason == "stop"
    assert "get_weather" in engine.decode(engine.calls[-1]["ids"])


def test_required_and_named_choice_generate_under_a_call_grammar() -> None:
    engine = FakeEngine(max_context=4096, reply=CALL.replace("Paris", "Rome"))
    client = client_for(engine)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model="fake-model",
        messages=USER,
        tools=[WEATHER],
        tool_choice=named,  # type: ignore[arg-type]
    )
    prompt = engine.decode(engine.calls[-1]["ids"])
    assert prompt.endswith("<assistant>")  # the prompt is not extended: its cache is shared
    fmt = engine.calls[-1]["params"].response_format
    assert fmt is not None and "get_weather" in fmt.what
    (call,) = out.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Rome"
    }
    out = client.chat.completions.create(
        model="fake-model", messages=USER, tools=[WEATHER], tool_choice="required"
    )
    assert engine.calls[-1]["params"].response_format is not None
    assert out.choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as err:
        other = {"type": "function", "function": {"name": "launch"}}
        client.chat.completions.create(
            model="fake-model",
            messages=USER,
            tools=[WEATHER],
            tool_choice=other,  # type: ignore[arg-type]
        )
    assert "launch" in str(err.value) and "get_weather" in str(err.value)


def test_history_with_tool_calls_and_tool_results_reaches_the_template() -> None:
    engine = FakeEngine(max_context=4096, reply="It is sunny.")
    messages: list[Any] = [
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
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    out = client_for(engine).chat.completions.create(
        model="fake-model", messages=messages, tools=[WEATHER]
    )
    assert out.choices[0].message.content == "It is sunny."
    prompt = engine.decode(engine.calls[-1]["ids"])
    assert '<call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool>sunny, 21C" in prompt
    bad = [*messages[:1], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0]}]}]
    bad[1]["tool_calls"][0]["function"] = {"name": "get_weather", "arguments": "{city"}
    with pytest.raises(openai.BadRequestError, match="arguments is not JSON"):
        client_for(engine).chat.completions.create(model="fake-model", messages=bad)


def test_a_template_that_cannot_render_tools_is_a_clear_400() -> None:
    engine = FakeEngine(
        max_context=4096, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(openai.BadRequestError) as err:
        client_for(engine).chat.completions.create(
            model="fake-model", messages=USER, tools=[WEATHER]
        )
    assert err.value.status_code == 400
    assert "does not render tools" in str(err.value)
    assert engine.calls == []  # refused before the engine


def test_anthropic_tool_use_create_and_stream_through_the_sdk() -> None:
    import anthropic

    engine = FakeEngine(max_context=4096, reply="On it." + CALL)
    http = TestClient(create_app(engine), raise_server_exceptions=False)
    client = anthropic.Anthropic(
        base_url="http://testserver", api_key="x", http_client=http, max_retries=0
    )
    tool: Any = {"name": "get_weather", "input_schema": {"type": "object"}}
    kw: Any = {"model": "fake-model", "max_tokens": 200, "messages": USER, "tools": [tool]}
    out = client.messages.create(**kw)
    assert out.stop_reason == "tool_use"
    assert [b.type for b in out.content] == ["text", "tool_use"]
    use = out.content[1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "text" and final.content[0].text == "On it."
    assert final.content[1].type == "tool_use" and final.content[1].input == {"city": "Paris"}
