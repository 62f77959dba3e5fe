"""/tokenize and /detokenize on a real server subprocess with a real tokenizer: the round
trip, a conversation's ids equal to the chat route's, and the API's keys, limits and
refusals of bad ids."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, running, start_server, tools_model_dir

pytestmark = pytest.mark.slow
__all__ = ["tools_model_dir"]  # a fixture, used by name

KEY = "tok-key"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server(tools_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(tools_model_dir, api_keys=[KEY]))


def post(server: ServerProc, path: str, body: dict[str, Any]) -> dict[str, Any]:
    with server.http(KEY) as http:
        r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_text_round_trips_through_tokenize_and_detokenize(server: ServerProc) -> None:
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 42"
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert bare["count"] == len(bare["tokens"]) > 5 and bare["token_strs"] is None
    assert bare["max_model_len"] == 4096
    assert post(server, "/detokenize", {"tokens": bare["tokens"]}) == {"prompt": text}
    # The tiny Llama's tokenizer adds a BOS by default; detokenize keeps it, as vLLM's does.
    full = post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert full["tokens"][1:] == bare["tokens"] and full["count"] == bare["count"] + 1
    assert len(full["token_strs"]) == full["count"]
    bos = full["token_strs"][0]
    assert bos.startswith("<") and post(server, "/detokenize", {"tokens": full["tokens"]}) == {
        "prompt": bos + text
    }


def test_a_conversations_ids_are_the_chat_routes(server: ServerProc) -> None:
    client = server.client(KEY)
    for tools in (None, TOOLS):
        tag = uuid.uuid4().hex
        messages: Any = [
            {"role": "system", "content": f"[{tag}] You answer about caches and foxes."},
            {"role": "user", "content": "What is a prefix cache, in one line?"},
        ]
        extra: dict[str, Any] = {"tools": tools} if tools else {}
        ids = post(server, "/tokenize", {"messages": messages, **extra})["tokens"]
        chat = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0, **extra
        )
        assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
        again = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0, **extra
        )
        # The same ids sent as a token prompt reuse exactly what the chat request does.
        same = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
        assert again.usage is not None and same.usage is not None
        assert same.usage.prompt_tokens == len(ids)
        assert again.usage.prompt_tokens_details is not None
        assert same.usage.prompt_tokens_details is not None
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and same.usage.prompt_tokens_details.cached_tokens == cached
    no_reply = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert 0 < no_reply["count"] < len(post(server, "/tokenize", {"messages": messages})["tokens"])


def test_keys_limits_and_bad_ids(server: ServerProc) -> None:
    with server.http() as anonymous:
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            r = anonymous.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with server.http(KEY) as http:
        r = http.post("/detokenize", json={"tokens": [1, 10**6]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        assert "vocabulary" in r.json()["error"]["message"]
        r = http.post("/detokenize", json={"tokens": [1, -3]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
        # The request limits walk these bodies too (2048 messages, 16 values each).
        r = http.post("/detokenize", json={"tokens": [1] * 40_000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_values"
        many = [{"role": "user", "content": "x"}] * 2049
        r = http.post("/tokenize", json={"messages": many})
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"
