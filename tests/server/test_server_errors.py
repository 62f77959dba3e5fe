"""Bad input against a real server subprocess: the right 4xx with an OpenAI error, never 5xx.

Hand-written cases for each kind of mistake, then a bounded schemathesis run
over the server's own OpenAPI schema.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_proc import ServerProc, running, small_context_model_dir, start_server

pytestmark = pytest.mark.slow
__all__ = ["small_context_model_dir"]  # a fixture, used by name

KEY = "k-errors"
LIMIT = 64 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def server(small_context_model_dir: Path) -> Iterator[ServerProc]:
    proc = start_server(
        small_context_model_dir, api_keys=[KEY], args=["--max-body-bytes", str(LIMIT)]
    )
    yield from running(proc)


@pytest.fixture(scope="module")
def http(server: ServerProc) -> Iterator[httpx.Client]:
    with server.http(KEY) as client:
        yield client


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 2, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


# (path, JSON body, expected status, expected `param` or None for "don't care")
JSON_CASES: list[tuple[str, Any, int, str | None]] = [
    (CHAT, [], 400, None),
    (CHAT, "just a string", 400, None),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0].image_url.url",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    (CHAT, {"messages": [{"role": "function", "content": "42"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": [{"role": "tool"}]}, 400, "messages[0].content"),
    (CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    (CHAT, chat(tool_choice="sometimes"), 400, "tool_choice"),
    (CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    (CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    (CHAT, chat(max_tokens=10**20), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=1000), 400, "max_completion_tokens"),
    (CHAT, chat(temperature=3), 400, "temperature"),
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, chat(top_p=1.5), 400, "top_p"),
    (CHAT, chat(top_k=-5), 400, "top_k"),
    (CHAT, chat(n=0), 400, "n"),
    (CHAT, chat(n=65), 400, "n"),
    (CHAT, chat(stop=5), 400, "stop"),
    (CHAT, chat(stop=""), 400, "stop"),
    (CHAT, chat(stop=["x"] * 17), 400, "stop"),
    (CHAT, chat(seed=2**70), 400, "seed"),
    (CHAT, chat(seed=1.5), 400, "seed"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(stream_options={"include_usage": "no"}), 400, "stream_options.include_usage"),
    (CHAT, chat(model="gpt-4"), 404, "model"),
    (CHAT, chat(model="x" * 10000), 404, "model"),
    (CHAT, chat(model=123), 400, "model"),
    (CHAT, chat(presence_penalty=2.5), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(min_p=1.5), 400, "min_p"),
    (CHAT, chat(logit_bias={"1": 500}), 400, "logit_bias.1"),
    (CHAT, chat(logit_bias={"x": 5}), 400, "logit_bias"),
    (CHAT, chat(logit_bias={"600": 5}), 400, "logit_bias"),  # beyond the vocabulary
    (CHAT, chat(logit_bias={"9" * 5000: 5}), 400, "logit_bias"),
    (CHAT, chat(stop_token_ids=[600]), 400, "stop_token_ids"),
    (CHAT, chat(top_logprobs=21, logprobs=True), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=2), 400, "top_logprobs"),  # needs logprobs: true
    (CHAT, chat(min_tokens=3), 400, "min_tokens"),
    (CHAT, chat(use_beam_search=True), 400, "use_beam_search"),
    (CHAT, chat(length_penalty=0.5), 400, "length_penalty"),
    (CHAT, chat(prompt_logprobs=1), 400, "prompt_logprobs"),
    (CHAT, chat(allowed_token_ids=[1, 2]), 400, "allowed_token_ids"),
    (CHAT, chat(bad_words=["x"]), 400, "bad_words"),
    (CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    (CHAT, chat(function_call="auto"), 400, "function_call"),
    # The tiny model's template never reads `tools`: the model could not see them.
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (CHAT, chat(response_format={"type": "regex"}), 400, "response_format.type"),
    (
        CHAT,
        chat(response_format={"type": "json_schema"}),
        400,
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strin"}},
            }
        ),
        400,
        "response_format.json_schema.schema",
    ),
    (COMPLETIONS, completion(response_format={"type": "xml"}), 400, "response_format.type"),
    (CHAT, chat(cache_salt=""), 400, "cache_salt"),
    (CHAT, chat(cache_salt="s" * 300), 400, "cache_salt"),
    (COMPLETIONS, {}, 400, "prompt"),
    (COMPLETIONS, completion(prompt=None), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[[1, 2], [3]]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[-1]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[10**12]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[600]), 400, "prompt"),  # beyond the 512-token vocabulary
    (COMPLETIONS, completion(prompt=[1.5]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[1] * 300), 400, "prompt"),  # beyond the 64-token context
    (COMPLETIONS, completion(echo=True), 400, "echo"),
    (COMPLETIONS, completion(best_of=3), 400, "best_of"),
    (COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    (COMPLETIONS, completion(min_tokens=2), 400, "min_tokens"),
    (COMPLETIONS, completion(suffix="end"), 400, "suffix"),
]


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    JSON_CASES,
    ids=[f"{i}-{'chat' if c[0] == CHAT else 'completion'}" for i, c in enumerate(JSON_CASES)],
)
def test_bad_json_fields(
    http: httpx.Client, path: str, body: Any, status: int, param: str | None
) -> None:
    assert_openai_error(http.post(path, json=body), status, param)


JSON = {"content-type": "application/json"}
RAW_CASES: list[tuple[bytes, dict[str, str], int]] = [
    (b'{"messages": [', {"content-type": "application/json"}, 400),
    (b"", {"content-type": "application/json"}, 400),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', {"content-type": "text/plain"}, 400),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', JSON, 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', {}, 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}', {}, 400),
    (b"[" * 30_000 + b"]" * 30_000, {"content-type": "application/json"}, 400),
    (b"\xff\xfe\x00garbage", {"content-type": "application/json"}, 400),
]


@pytest.mark.parametrize(("body", "headers", "status"), RAW_CASES)
def test_malformed_bodies(
    http: httpx.Client, body: bytes, headers: dict[str, str], status: int
) -> None:
    assert_openai_error(http.post(CHAT, content=body, headers=headers), status)


def test_body_too_large(http: httpx.Client) -> None:
    big = json.dumps(chat(user="x" * (2 * LIMIT))).encode()
    error = assert_openai_error(
        http.post(CHAT, content=big, headers={"content-type": "application/json"}), 413
    )
    assert str(LIMIT) in error["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the size is only known while reading
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    assert_openai_error(http.post(CHAT, content=chunks()), 413)
    assert http.get("/v1/models").status_code == 200  # the server is still fine


def test_routes_methods_and_auth_schemes(server: ServerProc, http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/nope"), 404)
    assert_openai_error(http.get(CHAT), 405)
    with server.http() as anon:
        assert_openai_error(
            anon.post(CHAT, json=chat(), headers={"Authorization": "Basic eDp5"}), 401
        )
        assert_openai_error(anon.post(CHAT, json=chat(), headers={"Authorization": "Bearer"}), 401)
        assert_openai_error(anon.post(CHAT, json=[]), 401)  # auth comes before the body


def test_no_request_above_left_the_server_unhealthy(server: ServerProc, http: httpx.Client) -> None:
    r = http.post(CHAT, json=chat(max_tokens=3, temperature=0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    metrics = http.get("/metrics").text
    counts = [line for line in metrics.splitlines() if line.startswith("pagedkv_http_requests")]
    server_errors = [line for line in counts if 'status="5' in line]
    assert server_errors == []
    assert "Traceback" not in server.log()


def test_schemathesis_finds_no_server_errors(server: ServerProc, tmp_path: Path) -> None:
    # Random cases only: the coverage phase's ~2,200 boundary cases took ~2 minutes,
    # and the hand-written cases above cover each kind of mistake.
    cmd = [
        str(SCHEMATHESIS), "run", f"{server.url}/openapi.json",
        "--header", f"Authorization: Bearer {KEY}",
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
        "--phases", "examples,fuzzing", "--max-examples", "15", "--seed", "20261202",
        "--workers", "1", "--request-timeout", "30",
        "--suppress-health-check", "all", "--no-shrink",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "Traceback" not in server.log(), server.log()[-8000:]
