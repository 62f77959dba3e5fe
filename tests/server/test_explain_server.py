"""POST /v1/cache/explain on a real server subprocess: the answer's shape, that it
agrees with what the next request reuses, per key, that it names the section of the
caller's own prompt, and that it shows nothing of another request's prompt, from RAM
or from the SSD tier after a restart."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, running, start_server, tools_model_dir

pytestmark = pytest.mark.slow
__all__ = ["tools_model_dir"]  # a fixture, used by name

KEY_A, KEY_B, ADMIN = "key-a", "key-b", "admin-key"


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(tools_model_dir, api_keys=[KEY_A, KEY_B], admin_keys=[ADMIN]))


def conversation(tag: str, question: str) -> list[dict[str, str]]:
    system = f"[{tag}] You answer questions about caches, blocks, hashes and the quick brown fox."
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def explain(server: ServerProc, key: str, messages: Any, **extra: Any) -> dict[str, Any]:
    with server.http(key) as http:
        r = http.post("/v1/cache/explain", json={"messages": messages, **extra})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_explain_agrees_with_the_next_request_and_hides_other_keys(server: ServerProc) -> None:
    tag = uuid.uuid4().hex
    first = conversation(tag, "What is a prefix cache?")
    new = explain(server, KEY_A, first)
    assert new["cached_tokens"] == 0 and new["miss"]["reason"] == "new"
    assert set(new) == {"prompt_tokens", "cached_tokens", "tiers", "miss"}
    assert set(new["tiers"]) == {"ram", "ssd", "redis"}
    client = server.client(KEY_A)
    done = client.chat.completions.create(model="tiny", messages=first, max_tokens=4)  # type: ignore[arg-type]
    assert done.usage is not None and done.usage.prompt_tokens == new["prompt_tokens"]
    second = conversation(tag, "What is a block hash?")
    exp = explain(server, KEY_A, second)
    assert exp["miss"]["reason"] == "diverged"
    reply = client.chat.completions.create(model="tiny", messages=second, max_tokens=4)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == exp["cached_tokens"]
    assert exp["miss"]["token_index"] == exp["cached_tokens"]
    assert "What is a " in exp["miss"]["detail"] or "What" in exp["miss"]["detail"]
    assert exp["miss"]["section"] == {"kind": "message", "message_index": 1, "role": "user"}
    # Key B sees nothing of key A's prompts, whatever A cached or lost.
    other = explain(server, KEY_B, first)
    assert other["cached_tokens"] == 0 and other["miss"]["reason"] == "new"
    assert other["miss"]["token_index"] == 0
    # A cache_salt of A's narrows further: also new.
    salted = explain(server, KEY_A, first, cache_salt="elsewhere")
    assert salted["miss"]["reason"] == "new"


def test_explain_after_a_clear_says_evicted(server: ServerProc) -> None:
    messages = conversation(uuid.uuid4().hex, "Will this survive a clear?")
    server.client(KEY_A).chat.completions.create(model="tiny", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert explain(server, KEY_A, messages)["miss"] is None
    with server.http(KEY_A) as http:
        assert http.post("/v1/cache/clear").status_code == 403  # a tenant may not clear
    with server.http(ADMIN) as http:
        assert http.post("/v1/cache/clear").status_code == 200
    exp = explain(server, KEY_A, messages)
    assert exp["cached_tokens"] == 0
    assert exp["miss"]["reason"] == "evicted" and "clear" in exp["miss"]["detail"]


def test_explain_refuses_what_a_request_would_refuse(server: ServerProc) -> None:
    with server.http(KEY_A) as http:
        assert http.post("/v1/cache/explain", json={"messages": []}).status_code == 400
        unknown = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
        r = http.post("/v1/cache/explain", json=unknown)
        assert r.status_code == 404
    with server.http() as anonymous:
        assert anonymous.post("/v1/cache/explain", json={"messages": []}).status_code == 401


# One application key, two of its end users: A's message goes on in words that B's
# never contains; none of them may appear in B's answer.
A_SECRET = ["zebra", "quokka", "narwhal"]


def secret_pair(tag: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    a = conversation(tag, "Please keep this note: " + " ".join(A_SECRET))
    b = conversation(tag, "Please keep this note: 0123456789 0123456789")
    return a, b


def assert_nothing_of_a(answer: dict[str, Any]) -> None:
    text = json.dumps(answer)
    for word in A_SECRET:
        assert word not in text, f"A's {word!r} is in B's answer: {text}"
    assert "zeb" not in text and "nar" not in text


def test_explain_shows_nothing_of_another_users_prompt(server: ServerProc) -> None:
    a, b = secret_pair(uuid.uuid4().hex)
    server.client(KEY_A).chat.completions.create(model="tiny", messages=a, max_tokens=4)  # type: ignore[arg-type]
    exp = explain(server, KEY_A, b)
    assert exp["miss"]["reason"] == "diverged" and exp["cached_tokens"] > 0
    assert_nothing_of_a(exp)
    assert exp["miss"]["section"] == {"kind": "message", "message_index": 1, "role": "user"}
    assert "0123" in exp["miss"]["detail"]  # the caller's own text may be quoted


def test_explain_shows_nothing_of_another_users_prompt_from_ssd_after_a_restart(
    tools_model_dir: Path, tmp_path: Path
) -> None:
    a, b = secret_pair(uuid.uuid4().hex)
    args = ["--ssd-cache-dir", str(tmp_path / "kv")]
    for server in running(start_server(tools_model_dir, api_keys=[KEY_A], args=args)):
        server.client(KEY_A).chat.completions.create(model="tiny", messages=a, max_tokens=4)  # type: ignore[arg-type]
    for server in running(start_server(tools_model_dir, api_keys=[KEY_A], args=args)):
        exp = explain(server, KEY_A, b)
        assert exp["miss"]["reason"] == "diverged" and exp["tiers"]["ssd"] > 0
        assert_nothing_of_a(exp)


def test_the_section_is_the_callers_system_prompt_or_message(server: ServerProc) -> None:
    tag = uuid.uuid4().hex
    turns = [
        *conversation(tag, "What is a prefix cache?"),
        {"role": "assistant", "content": "A store of computed keys and values."},
        {"role": "user", "content": "And what is a block hash?"},
    ]
    server.client(KEY_A).chat.completions.create(model="tiny", messages=turns, max_tokens=2)  # type: ignore[arg-type]
    system = [{**turns[0], "content": turns[0]["content"] + " Today is Monday."}, *turns[1:]]
    found = explain(server, KEY_A, system)["miss"]
    assert found["reason"] == "diverged"
    assert found["section"] == {"kind": "system", "message_index": 0, "role": "system"}
    third = [*turns[:3], {"role": "user", "content": "And what is a block pool?"}]
    found = explain(server, KEY_A, third)["miss"]
    assert found["section"] == {"kind": "message", "message_index": 3, "role": "user"}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    found = explain(server, KEY_A, turns, tools=tools)["miss"]
    assert found["reason"] == "diverged"
    assert found["section"] == {"kind": "tools", "message_index": None, "role": None}
