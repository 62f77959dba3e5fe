"""Prewarm and reasoning-aware storing through a real server: a tiny model whose chat
template strips earlier turns' reasoning the way Qwen3's does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_proc import ServerProc, running, start_server

pytestmark = pytest.mark.slow

KEY = "key-a"
TURN = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tiny_reasoning_dir: Path) -> Iterator[ServerProc]:
    yield from running(
        start_server(tiny_reasoning_dir, api_keys=[KEY], args=["--max-requests-per-key", "1"])
    )


@pytest.fixture(scope="module")
def server_off(tiny_reasoning_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(tiny_reasoning_dir, args=["--reasoning-cache", "off"]))


def _chat(http: httpx.Client, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = http.post("/v1/chat/completions", json={"messages": messages, **TURN})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _ids(http: httpx.Client, messages: list[dict[str, Any]]) -> list[int]:
    r = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _two_turns(srv: ServerProc, key: str | None, tag: str) -> tuple[int, int, str]:
    """Turn 2's cached tokens, the tokens before its new user message, its answer."""
    with srv.http(key) as http:
        history: list[dict[str, Any]] = [{"role": "user", "content": f"[{tag}] Plan the release."}]
        first = _chat(http, history)
        history.append({"role": "assistant", "content": first["choices"][0]["message"]["content"]})
        new = [{"role": "user", "content": "Now the second step, please."}]
        probe = _ids(http, [*history, {"role": "user", "content": "x"}])
        second_ids = _ids(http, history + new)
        upto = next(i for i, (a, b) in enumerate(zip(second_ids, probe, strict=False)) if a != b)
        # The store runs after the turn, in the background: wait until explain sees it
        # (the turn's stored form has not been computed yet when explain says 'new').
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = http.post("/v1/cache/explain", json={"messages": history + new})
            if r.json()["cached_tokens"] >= upto - 1 or srv is None:
                break
            time.sleep(0.1)
        second = _chat(http, history + new)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    return cached, upto, second["choices"][0]["message"]["content"]


def test_turn_two_hits_up_to_its_new_message_and_answers_as_fresh(
    server: ServerProc, server_off: ServerProc
) -> None:
    cached_off, upto, answer_off = _two_turns(server_off, None, "a")
    cached_on, upto_on, answer_on = _two_turns(server, KEY, "a")
    assert upto_on == upto
    assert cached_off < upto - 8  # without it, the stripped answer is recomputed
    assert cached_on >= upto - 1
    assert answer_on == answer_off


def test_prewarm_then_the_request_hits(server: ServerProc) -> None:
    messages = [
        {"role": "system", "content": "You prewarm caches. " * 6},
        {"role": "user", "content": "Which blocks are stored?"},
    ]
    with server.http(KEY) as http:
        r = http.post("/v1/cache/prewarm", json={"messages": messages})
        assert r.status_code == 200, r.text
        warm = r.json()
        assert warm["object"] == "cache.prewarm" and warm["cached_tokens"] < 16  # a block
        assert warm["stored_tokens"] == warm["prompt_tokens"]
        hit = _chat(http, messages)
        assert hit["usage"]["prompt_tokens"] == warm["prompt_tokens"]
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["prompt_tokens"] - 1
        # A Messages body, told apart by the header Anthropic's SDKs send.
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "max_tokens": 4, "system": "You prewarm caches. " * 6,
                "messages": [{"role": "user", "content": "Which blocks are stored?"}]}  # fmt: skip
        r = http.post("/v1/cache/prewarm", json=body, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 200, r.text
        assert r.json()["prompt_tokens"] == warm["prompt_tokens"]
        assert r.json()["cached_tokens"] == warm["prompt_tokens"] - 1
        r = http.post("/v1/cache/prewarm", json={"messages": messages, "frobnicate": 1})
        assert r.status_code == 400 and "frobnicate" in r.text


def test_prewarm_takes_the_keys_share(server: ServerProc) -> None:
    """With a share of one sequence, a prewarm while the key streams is a 429."""
    messages = [{"role": "user", "content": "Write at length."}]
    with server.http(KEY) as http:
        body = {"messages": messages, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as streaming:
            assert streaming.status_code == 200
            lines = streaming.iter_lines()
            for _ in range(20):  # tokens are flowing: the request holds its share
                next(lines)
            r = http.post("/v1/cache/prewarm", json={"messages": messages})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "key_share_exceeded"
        deadline = time.monotonic() + 20
        while True:
            r = http.post("/v1/cache/prewarm", json={"messages": messages})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text


def test_explain_names_stripped_reasoning(server_off: ServerProc) -> None:
    """Without the store, turn 2's miss is where turn 1's reasoning began; the answer
    quotes only this prompt's own text."""
    with server_off.http() as http:
        history: list[dict[str, Any]] = [{"role": "user", "content": "[e] Plan the tests."}]
        first = _chat(http, history)
        answer = first["choices"][0]["message"]["content"]
        history += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And then?"},
        ]
        r = http.post("/v1/cache/explain", json={"messages": history})
        assert r.status_code == 200, r.text
        miss = r.json()["miss"]
        assert miss["reason"] == "reasoning_stripped"
        assert "<think>" not in miss["detail"]  # what the cached turn had there is not shown
        assert r.json()["cached_tokens"] == miss["token_index"]
