"""What one request may cost the server before it is generated: every field counts
against the size caps, nesting is capped before anything recurses, prompt rendering
runs under the key's share (counted in sequences), and explain and count_tokens are
bounded by the model's context. Over a fake engine, in-process."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
from server_fake_engine import FakeEngine
from starlette.testclient import TestClient

from pagedkv.server.app import create_app
from pagedkv.server.limits import RequestLimits
from pagedkv.server.nesting import MAX_JSON_DEPTH

USER = [{"role": "user", "content": "hello there"}]
MESSAGES = {"model": "fake-model", "max_tokens": 4, "messages": USER}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def deep(levels: int) -> Any:
    value: Any = {"type": "object"}
    for _ in range(levels):
        value = {"type": "object", "properties": {"x": value}}
    return value


class GatedTemplate(FakeEngine):
    """A chat template that, for prompts containing "heavy", holds its thread until
    `gate` opens (at most 10 s): heavy rendering, on cue."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.rendering = 0

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        if any("heavy" in m["content"] for m in messages):
            with self.lock:
                self.rendering += 1
            try:
                self.gate.wait(10)
            finally:
                with self.lock:
                    self.rendering -= 1
        return super().apply_chat_template(messages, tools, **kwargs)

    def explain(self, prompt: Sequence[int], *, cache_salt: str | None = None, **_: Any) -> Any:
        raise AssertionError("explain reached the engine with a prompt past the context")


# -- item 4: work inside the key's share --------------------------------------------


def test_heavy_count_tokens_take_the_key_s_share_and_another_key_is_served() -> None:
    engine = GatedTemplate()
    client = TestClient(create_app(engine, api_keys=["a", "b"], max_requests_per_key=2))
    heavy = {**MESSAGES, "messages": [{"role": "user", "content": "heavy"}]}
    statuses: list[int] = []

    def count() -> None:
        r = client.post("/v1/messages/count_tokens", json=heavy, headers=bearer("a"))
        statuses.append(r.status_code)

    threads = [threading.Thread(target=count) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while engine.rendering < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert engine.rendering == 2
        for path, body in (
            ("/v1/messages/count_tokens", heavy),
            ("/v1/chat/completions", heavy),
            ("/v1/cache/explain", heavy),
        ):
            started = time.perf_counter()
            r = client.post(path, json=body, headers=bearer("a"))
            assert r.status_code == 429, (path, r.text)
            assert "--max-requests-per-key" in r.text
            assert time.perf_counter() - started < 2  # refused before it was rendered
        assert engine.rendering == 2
        started = time.perf_counter()
        r = client.post("/v1/messages/count_tokens", json=MESSAGES, headers=bearer("b"))
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        r = client.post("/v1/chat/completions", json=MESSAGES, headers=bearer("b"))
        assert r.status_code == 200
        assert time.perf_counter() - started < 2  # not queued behind key a's renders
    finally:
        engine.gate.set()
        for t in threads:
            t.join()
    assert statuses == [200, 200]
    state = client.app.state.pagedkv  # type: ignore[attr-defined]
    assert state.share._running == {}  # every share came back


def test_explain_and_count_tokens_refuse_prompts_past_the_context() -> None:
    engine = GatedTemplate(max_context=256)
    client = TestClient(create_app(engine), raise_server_exceptions=False)
    long = [{"role": "user", "content": "x" * 300}]
    r = client.post("/v1/messages/count_tokens", json={**MESSAGES, "messages": long})
    assert r.status_code == 400, r.text
    assert "256" in r.json()["error"]["message"] and r.json()["type"] == "error"
    r = client.post("/v1/cache/explain", json={"messages": long})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/messages/count_tokens", json=MESSAGES)
    assert r.status_code == 200 and 0 < r.json()["input_tokens"] < 256


# -- items 4 and 5: every field counts --------------------------------------------


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 1001}}]},
            "tools",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "text", "x": "y" * 1001}}, None),
        ("/v1/chat/completions", {"a_field_nobody_reads": "z" * 1001}, None),
        ("/v1/messages", {"metadata": {"user_id": "u" * 1001}}, None),
        (
            "/v1/messages/count_tokens",
            {"tools": [{"name": "f", "input_schema": {"type": "object", "d": "d" * 1001}}]},
            None,
        ),
        ("/v1/cache/explain", {"response_format": {"type": "text", "x": "y" * 1001}}, None),
    ],
)
def test_every_field_counts_against_max_content_chars(
    path: str, extra: dict[str, Any], param: str | None
) -> None:
    engine = FakeEngine(max_context=100_000)
    client = TestClient(create_app(engine, limits=RequestLimits(8, 1000)))
    r = client.post(path, json={**MESSAGES, **extra})
    assert r.status_code == 400, r.text
    assert "--max-content-chars" in r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
        assert r.json()["error"]["code"] == "content_too_large"
    assert engine.calls == []


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"response_format": {f"k{i}": 0 for i in range(100_000)}}),
        ("/v1/messages", {"metadata": {f"k{i}": [0] for i in range(50_000)}}),
        (
            "/v1/messages/count_tokens",
            {"tools": [{"name": "f", "input_schema": {"e": [0] * 10**5}}]},
        ),
    ],
)
def test_huge_free_form_dicts_are_refused_before_they_are_built(
    path: str, extra: dict[str, Any]
) -> None:
    """A few MiB of JSON in a field kept as `dict[str, Any]` used to cost 60-90 MiB of
    models per open request; the request limits refuse it from the raw JSON."""
    engine = FakeEngine(max_context=100_000)
    client = TestClient(create_app(engine))
    body = json.dumps({**MESSAGES, **extra})
    assert len(body) < 8 * 1024 * 1024  # under the body limit: the value count refuses it
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert "JSON values" in r.text and "--max-messages" in r.text
    assert engine.calls == []


# -- item 7: nesting is capped before anything recurses -----------------------------

TOOL_CALL_HISTORY = [
    {"role": "user", "content": "hi"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 50_000}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
]


def anthropic_shapes(levels: int) -> list[dict[str, Any]]:
    return [
        {"tools": [{"name": "f", "input_schema": deep(levels)}]},
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "t", "name": "f", "input": deep(levels)}
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
                },
            ]
        },
    ]


SHAPES = [
    ("/v1/chat/completions", {"messages": TOOL_CALL_HISTORY}),
    (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": deep(450)}}]},
    ),
    ("/v1/cache/explain", {"messages": TOOL_CALL_HISTORY}),
    *[("/v1/messages", shape) for shape in anthropic_shapes(450)],
    *[("/v1/messages/count_tokens", shape) for shape in anthropic_shapes(450)],
]


@pytest.mark.parametrize(("path", "extra"), SHAPES)
def test_deep_nesting_is_a_400_without_a_traceback(
    path: str, extra: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngine(max_context=100_000)
    client = TestClient(create_app(engine), raise_server_exceptions=False)
    with caplog.at_level(logging.INFO):
        r = client.post(path, json={**MESSAGES, **extra})
    assert r.status_code == 400, r.text[:300]
    assert "nest" in r.text and str(MAX_JSON_DEPTH) in r.text
    assert not [rec for rec in caplog.records if rec.exc_info]
    assert sum(len(rec.getMessage()) for rec in caplog.records) < 2000
    assert engine.calls == []


def test_nesting_within_the_cap_is_served() -> None:
    engine = FakeEngine(max_context=100_000)
    client = TestClient(create_app(engine))
    # body, tools, [0], input_schema, then two levels per deep(): within MAX_JSON_DEPTH.
    fine = anthropic_shapes((MAX_JSON_DEPTH - 5) // 2)[0]
    r = client.post("/v1/messages/count_tokens", json={**MESSAGES, **fine})
    assert r.status_code == 200, r.text[:300]


# -- item 12: the share counts sequences -----------------------------------------


def test_a_key_s_share_counts_the_n_samples_of_its_requests() -> None:
    engine = FakeEngine(token_delay=0.02)
    client = TestClient(create_app(engine, api_keys=["a", "b"], max_requests_per_key=4))
    long = {"prompt": "slow", "max_tokens": 200, "ignore_eos": True, "n": 4, "stream": True}
    with client.stream("POST", "/v1/completions", json=long, headers=bearer("a")) as stream:
        assert stream.status_code == 200
        quick = {"prompt": "quick", "max_tokens": 1}
        r = client.post("/v1/completions", json=quick, headers=bearer("a"))
        assert r.status_code == 429 and r.json()["error"]["code"] == "key_share_exceeded"
        assert "4 sequences" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json=MESSAGES, headers=bearer("b"))
        assert r.status_code == 200  # the other key's share is its own
    deadline = time.monotonic() + 10
    while engine.active and time.monotonic() < deadline:
        time.sleep(0.01)
    r = client.post("/v1/completions", json=quick, headers=bearer("a"))
    assert r.status_code == 200  # the four came back when the stream closed
    r = client.post("/v1/completions", json={**quick, "n": 5}, headers=bearer("a"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "at most 4" in r.json()["error"]["message"]


class DeepFailure(FakeEngine):
    """A template that fails 400 frames deep: with `error` RecursionError, a RecursionError
    that slipped past the caps; otherwise a bug with a long traceback."""

    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.error = error

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        def down(n: int) -> list[int]:
            if n == 0:
                raise self.error("deep failure")
            return up(n - 1)

        def up(n: int) -> list[int]:
            return down(n)

        return down(400)


def test_a_recursion_error_anywhere_is_a_400_and_a_500_s_traceback_is_cut(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pagedkv.server.middleware import MAX_TRACE_CHARS

    client = TestClient(create_app(DeepFailure(RecursionError)), raise_server_exceptions=False)
    with caplog.at_level(logging.INFO):
        r = client.post("/v1/messages/count_tokens", json=MESSAGES)
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert not [rec for rec in caplog.records if rec.exc_info]
        caplog.clear()
        client = TestClient(create_app(DeepFailure(RuntimeError)), raise_server_exceptions=False)
        r = client.post("/v1/chat/completions", json=MESSAGES)
    assert r.status_code == 500
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1  # once, as one record
    text = errors[0].getMessage()
    assert "characters of traceback cut" in text and "RuntimeError: deep failure" in text
    assert len(text) < MAX_TRACE_CHARS + 500


def test_a_schema_too_big_to_compile_is_refused_before_it_is_compiled() -> None:
    """A 1.4 MB response_format schema took seconds of CPU to compile, outside every
    queue; past MAX_SCHEMA_CHARS it is a 400, for response_format and for the tools a
    required tool call is generated under."""
    from pagedkv.engine.grammar import MAX_SCHEMA_CHARS

    client = TestClient(create_app(FakeEngine()))
    huge = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(8000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": huge}}
    r = client.post("/v1/chat/completions", json={**MESSAGES, "response_format": fmt})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"
    assert str(MAX_SCHEMA_CHARS) in r.json()["error"]["message"]
    small = {"type": "object", "properties": {"k": {"type": "string"}}}
    ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": small}}
    assert client.post("/v1/chat/completions", json={**MESSAGES, "response_format": ok}).is_success


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", {**MESSAGES, "reasoning_effort": "high"}, "reasoning_effort"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": {}}, "guided_json"),
        ("/v1/messages", {**MESSAGES, "container": "c1"}, "container"),
        ("/v1/messages/count_tokens", {**MESSAGES, "container": "c1"}, "container"),
    ],
)
def test_a_field_the_server_cannot_honour_is_refused_not_ignored(
    path: str, body: dict[str, Any], field: str
) -> None:
    client = TestClient(create_app(FakeEngine()))
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert field in r.text and "cannot use the field" in r.text
    del body[field]
    assert client.post(path, json=body).status_code == 200


def test_extended_thinking_is_refused_and_disabled_thinking_honoured() -> None:
    client = TestClient(create_app(FakeEngine()))
    on = {**MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    r = client.post("/v1/messages", json=on)
    assert r.status_code == 400 and "thinking" in r.text
    off = {**MESSAGES, "thinking": {"type": "disabled"}}
    assert client.post("/v1/messages", json=off).status_code == 200
