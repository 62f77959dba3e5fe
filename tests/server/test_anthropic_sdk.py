"""The Anthropic Messages API of a real server subprocess, through the official SDK."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from server_proc import ServerProc, running, start_server, tools_model_dir

pytestmark = pytest.mark.slow
__all__ = ["tools_model_dir"]  # a fixture, used by name

KEY = "sk-ant-test"
# This SDK's create() takes no sampling arguments: they travel in extra_body.
GREEDY: dict[str, Any] = {"model": "tiny", "extra_body": {"temperature": 0.0}}
WEATHER: Any = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(tools_model_dir, api_keys=[KEY]))


@pytest.fixture(scope="module")
def client(server: ServerProc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def fresh() -> str:
    return f"[{uuid.uuid4().hex}] tell me about caches and the quick brown fox, twice over"


def test_create_reports_usage_that_sums_to_the_prompt_and_reuses_the_cache(
    client: anthropic.Anthropic,
) -> None:
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    kw: dict[str, Any] = {"system": system, "messages": user(fresh()), "max_tokens": 6, **GREEDY}
    first = client.messages.create(**kw)
    assert first.type == "message" and first.role == "assistant" and first.model == "tiny"
    assert first.content[0].type == "text" and first.content[0].text
    assert first.stop_reason in ("max_tokens", "end_turn")
    counted = client.messages.count_tokens(
        model="tiny", system=system, messages=kw["messages"]
    ).input_tokens
    u = first.usage
    assert u.cache_read_input_tokens == 0
    assert u.input_tokens + (u.cache_creation_input_tokens or 0) == counted
    # Created: the whole 16-token blocks up to the system prompt's breakpoint, leased.
    assert 0 <= (u.cache_creation_input_tokens or 0) < counted - 16
    second = client.messages.create(**kw)
    v = second.usage
    assert v.cache_read_input_tokens and v.cache_read_input_tokens >= counted - 16
    assert v.input_tokens + v.cache_read_input_tokens + (v.cache_creation_input_tokens or 0) == (
        counted
    )
    assert second.content[0].text == first.content[0].text  # type: ignore[union-attr]


def test_system_as_a_string_and_as_blocks_is_the_same_prompt(client: anthropic.Anthropic) -> None:
    msgs = user("hello")
    as_str = client.messages.count_tokens(model="tiny", system="Be brief.", messages=msgs)
    as_blocks = client.messages.count_tokens(
        model="tiny", system=[{"type": "text", "text": "Be brief."}], messages=msgs
    )
    none = client.messages.count_tokens(model="tiny", messages=msgs)
    assert as_str.input_tokens == as_blocks.input_tokens > none.input_tokens


def test_stop_sequences_and_top_k(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"messages": user(fresh()), "max_tokens": 24, **GREEDY}
    free = client.messages.create(**kw).content[0].text  # type: ignore[union-attr]
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), f"need a visible stop string from {free!r}"
    cut = client.messages.create(**kw, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free[: free.index(stop)]  # type: ignore[union-attr]
    # top_k=1 is greedy whatever the temperature.
    picked = client.messages.create(
        messages=kw["messages"], max_tokens=24, model="tiny",
        extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9},
    )  # fmt: skip
    assert picked.content[0].text == free  # type: ignore[union-attr]


def test_stream_sends_the_anthropic_event_sequence(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"messages": user(fresh()), "max_tokens": 8, **GREEDY}
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"]
    assert final.content[0].text == plain.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.cache_read_input_tokens  # the second time, from the cache


def test_tools_and_tool_blocks_reach_the_template(client: anthropic.Anthropic) -> None:
    msgs = user("weather in Paris?")
    bare = client.messages.count_tokens(model="tiny", messages=msgs).input_tokens
    with_tools = client.messages.count_tokens(model="tiny", messages=msgs, tools=[WEATHER])
    assert with_tools.input_tokens > bare + 10
    history: list[Any] = [
        *msgs,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "P"},
                },
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"}],
        },
    ]
    turn = client.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER])
    assert turn.input_tokens > with_tools.input_tokens + 10
    out = client.messages.create(messages=history, tools=[WEATHER], max_tokens=4, **GREEDY)
    assert out.stop_reason == "max_tokens"  # a random model writes no call


def test_errors_have_anthropic_shape_and_status(
    client: anthropic.Anthropic, server: ServerProc
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(messages=user("hi"), max_tokens=0, model="tiny")
    assert bad.value.status_code == 400
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(messages=user("hi"), max_tokens=4, model="claude-x")
    assert missing.value.body["type"] == "error"  # type: ignore[index]
    assert "claude-x" in missing.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match=r"source\.media_type"):
        image = {"type": "image", "source": {"type": "base64", "data": "x"}}
        client.messages.create(
            messages=[{"role": "user", "content": [image]}], max_tokens=4, model="tiny"
        )
    with pytest.raises(anthropic.BadRequestError, match="context"):
        client.messages.create(messages=user("fox " * 5000), max_tokens=4, model="tiny")
    r = httpx.post(server.url + "/v1/messages", content=b"{", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_x_api_key_and_bearer_both_authenticate(server: ServerProc) -> None:
    kw: dict[str, Any] = {"messages": user("hi"), "max_tokens": 2, "model": "tiny"}
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(**kw).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            **kw
        )
    assert err.value.status_code == 401
    assert err.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    no_key = httpx.post(server.url + "/v1/messages", json={**kw, "messages": user("hi")})
    assert no_key.status_code == 401 and "x-api-key" in no_key.json()["error"]["message"]
