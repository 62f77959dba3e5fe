"""Structured outputs and required tool calls through both APIs, on a real tiny model
whose Hermes-style template renders tools: a random model never writes a call by
itself, so every call below exists because the grammar forced it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from pagedkv import CacheConfig, Engine
from pagedkv.server.app import create_app

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
USER: Any = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from fixtures_models import TOOLS_CHAT_TEMPLATE, make_tiny_model

    path = make_tiny_model(
        tmp_path_factory.mktemp("structured") / "tiny", chat_template=TOOLS_CHAT_TEMPLATE
    )
    with Engine.from_pretrained(str(path), config=CacheConfig(block_size=8)) as engine:
        yield TestClient(create_app(engine, model_name="tiny"))


def valid_args(name: str, args: dict[str, Any]) -> None:
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        assert isinstance(args["city"], str) and len(args["city"]) <= 8
    else:
        assert name == "get_time" and set(args) == {"zone"} and -12 <= args["zone"] <= 14


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_always_calls_with_valid_arguments(
    http: TestClient, seed: int
) -> None:
    body = {
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 300,
        "seed": seed,
        "temperature": 1.0,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["tool_calls"]
    for call in choice["message"]["tool_calls"]:
        valid_args(call["function"]["name"], json.loads(call["function"]["arguments"]))


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_a_named_function_is_the_one_called(http: TestClient, name: str) -> None:
    choice = {"type": "function", "function": {"name": name}}
    body = {
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": 300,
        "temperature": 1.0,
        "seed": 3,
    }
    r = http.post("/v1/chat/completions", json=body)
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == name
    valid_args(name, json.loads(call["function"]["arguments"]))


def test_a_streamed_required_call_arrives_whole(http: TestClient) -> None:
    body = {
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 300,
        "seed": 1,
        "temperature": 1.0,
        "stream": True,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in lines if c["choices"]]
    assert not any(d.get("content") for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    name = next(tc["function"]["name"] for tc in calls if tc["function"].get("name"))
    args = "".join(tc["function"]["arguments"] for tc in calls if tc["index"] == 0)
    valid_args(name, json.loads(args))
    assert lines[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_messages_tool_choice_any_and_tool_force_a_valid_tool_use(
    http: TestClient, tool_choice: dict[str, Any]
) -> None:
    tools = [
        {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    body = {
        "model": "tiny",
        "messages": USER,
        "tools": tools,
        "tool_choice": tool_choice,
        "max_tokens": 300,
        "temperature": 1.0,
    }
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop_reason"] == "tool_use"
    uses = [b for b in out["content"] if b["type"] == "tool_use"]
    assert uses
    for use in uses:
        valid_args(use["name"], use["input"])
        if tool_choice["type"] == "tool":
            assert use["name"] == "get_time"


def test_json_schema_and_json_object_on_chat_and_completions(http: TestClient) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
    }
    for path, extra in (
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/completions", {"prompt": "Weather:"}),
    ):
        r = http.post(
            path,
            json={
                **extra,
                "response_format": fmt,
                "max_tokens": 200,
                "temperature": 1.0,
                "seed": 2,
            },
        )
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop"
        valid_args("get_weather", json.loads(text))
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": USER,
            "response_format": {"type": "json_object"},
            "max_tokens": 50,
            "temperature": 0,
        },
    )
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)


def test_bad_schemas_and_formats_are_400s_naming_the_problem(http: TestClient) -> None:
    bad = {
        "type": "json_schema",
        "json_schema": {
            "name": "w",
            "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
        },
    }
    r = http.post("/v1/chat/completions", json={"messages": USER, "response_format": bad})
    assert r.status_code == 400 and "nowhere" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    r = http.post(
        "/v1/chat/completions", json={"messages": USER, "response_format": {"type": "grammar"}}
    )
    assert r.status_code == 400 and "'grammar'" in r.json()["error"]["message"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    r = http.post(
        "/v1/chat/completions", json={"messages": USER, "tools": tools, "tool_choice": "required"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    both = {
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    assert http.post("/v1/chat/completions", json=both).status_code == 400
