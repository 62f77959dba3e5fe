"""POST /v1/messages/explain on a real server subprocess: an Anthropic body (top-level
system, tools, tool blocks) is explained as /v1/messages renders and caches it, with
sections named by the body's own messages; /v1/cache/explain refuses that shape."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, running, start_server, tools_model_dir

pytestmark = pytest.mark.slow
__all__ = ["tools_model_dir"]  # a fixture, used by name

KEY = "explain-key"
WEATHER: Any = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(tools_model_dir, api_keys=[KEY]))


def post(server: ServerProc, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with server.http(KEY) as http:
        r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def body(tag: str, last: str = "And what is a block hash?") -> dict[str, Any]:
    """A Messages body with a top-level system prompt, tools and a tool round trip."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "P"}}
    return {
        "model": "tiny",
        "system": f"[{tag}] You answer questions about caches, blocks and the quick brown fox.",
        "tools": [WEATHER],
        "max_tokens": 2,
        "temperature": 0.0,
        "messages": [
            {"role": "user", "content": "What is a prefix cache? And the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, call]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"},
                    {"type": "text", "text": last},
                ],
            },
        ],
    }


def test_explain_takes_the_anthropic_shape_and_agrees_with_messages(server: ServerProc) -> None:
    request = body(uuid.uuid4().hex)
    counted = post(server, "/v1/messages/count_tokens", {
        k: v for k, v in request.items() if k not in ("max_tokens", "temperature")
    })["input_tokens"]  # fmt: skip
    new = post(server, "/v1/messages/explain", request)
    assert set(new) == {"prompt_tokens", "cached_tokens", "tiers", "miss"}
    assert new["prompt_tokens"] == counted and new["cached_tokens"] == 0
    assert new["miss"]["reason"] == "new"
    assert new["miss"]["section"] == {"kind": "system", "message_index": None, "role": "system"}
    # max_tokens may be left out: it cannot change the prompt.
    no_max = {k: v for k, v in request.items() if k != "max_tokens"}
    assert post(server, "/v1/messages/explain", no_max)["prompt_tokens"] == counted

    sent = post(server, "/v1/messages", request)
    assert sent["usage"]["input_tokens"] + sent["usage"]["cache_creation_input_tokens"] == counted
    hit = post(server, "/v1/messages/explain", request)
    assert hit["prompt_tokens"] == counted and hit["cached_tokens"] > 0
    again = post(server, "/v1/messages", request)
    assert again["usage"]["cache_read_input_tokens"] == hit["cached_tokens"]


def test_the_section_is_named_by_the_bodys_own_messages(server: ServerProc) -> None:
    tag = uuid.uuid4().hex
    post(server, "/v1/messages", body(tag))
    # The chat form is system, user, assistant, tool, user: the last text is its
    # message 4, and the body's message 2.
    changed = post(server, "/v1/messages/explain", body(tag, last="And what is a block pool?"))
    assert changed["miss"]["reason"] == "diverged" and changed["cached_tokens"] > 0
    assert changed["miss"]["section"] == {"kind": "message", "message_index": 2, "role": "user"}
    other_system = {**body(tag), "system": f"[{tag}] You answer questions. Today is Monday."}
    found = post(server, "/v1/messages/explain", other_system)["miss"]
    assert found["reason"] == "diverged"
    assert found["section"] == {"kind": "system", "message_index": None, "role": "system"}


def test_cache_explain_refuses_the_anthropic_shape_it_used_to_drop(server: ServerProc) -> None:
    request = body(uuid.uuid4().hex)
    openai_shape = {
        "model": "tiny",
        "max_tokens": 2,
        "system": request["system"],
        "messages": [{"role": "user", "content": "What is a prefix cache?"}],
    }
    with server.http(KEY) as http:
        r = http.post("/v1/cache/explain", json=openai_shape)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "system"
        assert "/v1/messages/explain" in r.json()["error"]["message"]
        r = http.post("/v1/messages/explain", json={**request, "n": 2})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "'n'" in r.json()["error"]["message"]
    with server.http() as anonymous:
        r = anonymous.post("/v1/messages/explain", json=request)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
