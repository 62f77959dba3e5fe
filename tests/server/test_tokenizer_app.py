"""/tokenize, /detokenize and the explain routes' field checks, in-process over the fake
engine: the shapes, refusals by field, and that the key's share and the request limits
apply. The real tokenizer's round trip is in test_tokenizer_server.py."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from server_fake_engine import EOS, FakeEngine
from starlette.testclient import TestClient

from pagedkv.server.app import create_app
from pagedkv.server.limits import RequestLimits

USER = [{"role": "user", "content": "hello there"}]
KEY = "key-a"


def make_client(engine: FakeEngine | None = None, **kwargs: Any) -> TestClient:
    return TestClient(create_app(engine or FakeEngine(), **kwargs), raise_server_exceptions=False)


def test_tokenize_text_and_messages_in_vllms_shape() -> None:
    engine = FakeEngine()
    client = make_client(engine)
    r = client.post("/tokenize", json={"model": "fake-model", "prompt": "hi"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "count": 2,
        "max_model_len": 256,
        "tokens": engine.tokenize("hi"),
        "token_strs": None,
    }
    r = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert r.json()["token_strs"] == ["b'h'", "b'i'"]
    r = client.post("/tokenize", json={"messages": USER})
    assert r.json()["tokens"] == engine.apply_chat_template(USER)
    r = client.post("/tokenize", json={"messages": USER, "add_generation_prompt": False})
    assert r.json()["tokens"] == engine.apply_chat_template(USER, add_generation_prompt=False)
    assert r.json()["count"] == len(engine.apply_chat_template(USER)) - len("<assistant>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = client.post("/tokenize", json={"messages": USER, "tools": tools})
    assert r.json()["tokens"] == engine.apply_chat_template(USER, [tools[0]])


def test_detokenize_keeps_special_tokens_and_refuses_bad_ids_by_field() -> None:
    engine = FakeEngine()
    client = make_client(engine)
    ids = [*engine.tokenize("hi"), EOS]
    r = client.post("/detokenize", json={"model": "fake-model", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "hi<eos>"}
    for bad, param in (([1, 301], "tokens"), ([1, -1], "tokens[1]"), ([2**40], "tokens[0]")):
        r = client.post("/detokenize", json={"tokens": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert "vocabulary" in client.post("/detokenize", json={"tokens": [301]}).text
    r = client.post("/detokenize", json={"tokens": "abc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_tokenize_refuses_what_it_cannot_use_by_name() -> None:
    client = make_client()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "x", "continue_final_message": True}, "continue_final_message"),
        ({"messages": USER, "chat_template": "{{ x }}"}, "chat_template"),
        ({"prompt": "x", "messages": USER}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"prompt": "x", "tools": []}, "tools"),
        ({"messages": USER, "add_special_tokens": True}, "add_special_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ]
    for body, param in cases:
        r = client.post("/tokenize", json=body)
        assert r.status_code == 400, (body, r.text)
        assert (r.json()["error"]["param"] or "").startswith(param), (body, r.json())
    r = client.post("/detokenize", json={"tokens": [1], "skip_special_tokens": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"
    assert r.json()["error"]["code"] == "unknown_field"
    assert client.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}).status_code == 404


def test_tokenizer_routes_need_a_key_when_the_server_has_keys() -> None:
    client = make_client(api_keys=[KEY])
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = client.post(path, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = client.post(path, json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = client.post(path, json=body, headers={"x-api-key": KEY})
        assert r.status_code == 200, r.text


def test_the_request_limits_walk_the_tokenizer_bodies() -> None:
    client = make_client(limits=RequestLimits(max_messages=4, max_content_chars=100))
    r = client.post("/tokenize", json={"messages": USER * 5})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"
    r = client.post("/tokenize", json={"prompt": "x" * 200})
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_too_large"
    r = client.post("/detokenize", json={"tokens": [1] * 100})  # 16 values per message allowed
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_values"
    assert client.post("/detokenize", json={"tokens": [1] * 60}).status_code == 200


class GatedEngine(FakeEngine):
    """Tokenizing and decoding wait for `gate`, so a request holds its key's share."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]:
        self.entered.set()
        assert self.gate.wait(10)
        return super().tokenize(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.entered.set()
        assert self.gate.wait(10)
        return super().decode(ids, skip_special_tokens)


def check_share_is_taken(path: str, body: dict[str, Any]) -> None:
    """While one request of the key is tokenizing, a second of the same key gets a 429."""
    engine = GatedEngine()
    client = make_client(engine, api_keys=[KEY, "key-b"], max_requests_per_key=1)
    headers = {"x-api-key": KEY}
    first: list[int] = []
    thread = threading.Thread(
        target=lambda: first.append(client.post(path, json=body, headers=headers).status_code)
    )
    thread.start()
    try:
        assert engine.entered.wait(10)
        r = client.post(path, json=body, headers=headers)
        assert r.status_code == 429 and r.json()["error"]["code"] == "key_share_exceeded"
    finally:
        engine.gate.set()
        thread.join(10)
    assert first == [200]
    assert client.post(path, json=body, headers=headers).status_code == 200


def test_tokenizing_takes_one_sequence_of_the_keys_share() -> None:
    check_share_is_taken("/tokenize", {"prompt": "x"})
    check_share_is_taken("/detokenize", {"tokens": [2]})


def test_cache_explain_refuses_an_anthropic_top_level_system() -> None:
    client = make_client()
    body = {"model": "fake-model", "system": "Be brief.", "messages": USER, "max_tokens": 4}
    r = client.post("/v1/cache/explain", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "system" and error["code"] == "unknown_field"
    assert "/v1/messages/explain" in error["message"]
    r = client.post("/v1/cache/explain", json={"messages": USER, "stop_sequences": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_sequences"


def test_messages_explain_refuses_unknown_fields_in_anthropics_error_shape() -> None:
    client = make_client()
    body = {"model": "fake-model", "messages": USER, "response_format": {"type": "text"}}
    r = client.post("/v1/messages/explain", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "response_format" in r.json()["error"]["message"]
    assert "/v1/cache/explain" in r.json()["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "data": "x"}}
    r = client.post(
        "/v1/messages/explain",
        json={"model": "fake-model", "messages": [{"role": "user", "content": [image]}]},
    )
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]
    r = client.post("/v1/messages/explain", json={"model": "claude-x", "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = make_client(api_keys=[KEY]).post("/v1/messages/explain", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
