"""The server's one log line per request (`server/request_log.py`), read from a real
server's log: its fields match what the client got, a refusal logs its reason, a key
is named by its label only, and client text cannot forge a line."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_proc import ServerProc, running, server_model_dir, start_server

__all__ = ["server_model_dir"]

KEY = "sk-request-log-test-key-0123456789"
OTHER_KEY = "sk-second-key-abcdef"
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


@pytest.fixture(scope="module")
def server(server_model_dir: Path) -> Iterator[ServerProc]:
    yield from running(start_server(server_model_dir, api_keys=[OTHER_KEY, KEY]))


def log_line(server: ServerProc, request_id: str, timeout: float = 10.0) -> str:
    """The one line of `request_id` (it is written once the response has gone out)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in server.log().splitlines() if f" {request_id} " in line]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(lines) == 1, lines
    assert "pagedkv.requests" in lines[0]
    return lines[0]


def fields(line: str) -> dict[str, str]:
    return {k: v for k, v in FIELD.findall(line)}


def chat(server: ServerProc, content: str) -> tuple[str, dict[str, object]]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 5,
        "temperature": 0,
    }
    with server.http(KEY) as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"], r.json()


def test_one_line_per_request_with_what_the_cache_did(server: ServerProc) -> None:
    content = "Tell me about the paged KV cache, the blocks, and the tiers below RAM. " * 3
    request_id, reply = chat(server, content)
    usage = reply["usage"]
    assert isinstance(usage, dict)
    line = log_line(server, request_id)
    f = fields(line)
    assert f["key"] == "key2", "the second key given, never the key itself"
    assert KEY not in server.log()
    assert '"POST /v1/chat/completions" 200' in line
    assert int(f["prompt_tokens"]) == usage["prompt_tokens"] > 32
    assert int(f["cached_ram"]) == int(f["cached_ssd"]) == int(f["cached_redis"]) == 0
    assert int(f["generated_tokens"]) == usage["completion_tokens"] == 5
    assert f["finish"] == "length"
    ttft, total = float(f["ttft_ms"]), float(f["total_ms"])
    assert 0 < ttft <= total

    again_id, again = chat(server, content)
    assert again_id != request_id
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
    f = fields(log_line(server, again_id))
    assert int(f["cached_ram"]) == cached > 0
    assert int(f["prompt_tokens"]) == usage["prompt_tokens"]

    # The line replaces uvicorn's access line: nothing says the same twice.
    assert 'HTTP/1.1" 200' not in server.log()


def test_a_refusal_logs_its_reason_and_the_request_id(server: ServerProc) -> None:
    with server.http(KEY) as http:
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": "hello"})
    assert r.status_code == 400
    line = log_line(server, r.headers["x-request-id"])
    f = fields(line)
    assert '"POST /v1/chat/completions" 400' in line
    assert f["key"] == "key2"
    assert "messages" in f["reason"] and f["reason"] == '"' + r.json()["error"]["message"] + '"'
    assert "prompt_tokens" not in f, "a refused request generated nothing"


def test_a_wrong_key_is_logged_without_the_key(server: ServerProc) -> None:
    wrong = "sk-wrong-key-that-must-not-be-logged"
    with server.http(wrong) as http:
        r = http.get("/v1/models")
    assert r.status_code == 401
    f = fields(log_line(server, r.headers["x-request-id"]))
    assert f["key"] == "-"
    assert f["reason"] == '"invalid API key"'
    assert wrong not in server.log()


def test_client_text_cannot_forge_a_log_line(server: ServerProc) -> None:
    with server.http(KEY) as http:
        r = http.get("/v1/models/x%0A2099-01-01 INFO pagedkv.requests: forged")
    assert r.status_code == 404
    log_line(server, r.headers["x-request-id"])
    assert not any(line.startswith("2099-01-01") for line in server.log().splitlines())


def test_key_labels_follow_the_order_keys_were_given() -> None:
    from pagedkv.server.auth import ANONYMOUS, KeyRing

    ring = KeyRing(["k-a", "k-b", "k-a"], ["k-c", "k-a"])
    labels = {k: ring.lookup(k).label for k in ("k-a", "k-b", "k-c")}  # type: ignore[union-attr]
    assert labels == {"k-a": "admin2", "k-b": "key2", "k-c": "admin1"}
    assert ANONYMOUS.label == "-"
