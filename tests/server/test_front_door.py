"""The front door over a fake engine: keys checked before the body, limits on one request,
each key's share of running requests, and what /v1/cache/stats shows to whom."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from server_fake_engine import FakeEngine
from starlette.testclient import TestClient

from pagedkv.server.app import create_app
from pagedkv.server.limits import RequestLimits

USER = [{"role": "user", "content": "hello there"}]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def call_asgi(app: Any, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any, int]:
    """One POST straight through the ASGI app: (status, JSON body, receive() calls)."""
    received = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        received += 1
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        + [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(payload), received


def test_no_key_and_broken_json_is_401_before_the_body_is_read() -> None:
    app = create_app(FakeEngine(), api_keys=["a"])
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        status, body, received = call_asgi(app, path, b"{not json", {})
        assert status == 401, (path, body)
        assert received == 0  # not one byte of the body was asked for
        status, _, _ = call_asgi(app, path, b"{not json", bearer("wrong"))
        assert status == 401
    _, body, _ = call_asgi(app, "/v1/messages", b"{", {})
    assert body["error"]["type"] == "authentication_error"  # Anthropic's shape there
    status, body, _ = call_asgi(app, "/v1/chat/completions", b"{not json", bearer("a"))
    assert status == 400 and "not valid JSON" in body["error"]["message"]


def test_200k_messages_are_refused_in_well_under_a_second() -> None:
    engine = FakeEngine()
    app = create_app(engine)
    many = [{"role": "user", "content": "x"}] * 200_000
    for path, extra in (("/v1/chat/completions", {}), ("/v1/messages", {"max_tokens": 4})):
        body = json.dumps({"model": "fake-model", "messages": many, **extra}).encode()
        assert len(body) < 8 * 1024 * 1024  # under the body limit: the message cap refuses it
        started = time.perf_counter()
        status, answer, _ = call_asgi(app, path, body, {})
        elapsed = time.perf_counter() - started
        assert status == 400, answer
        text = json.dumps(answer)
        assert "200000 messages" in text and "2048" in text and "--max-messages" in text
        assert elapsed < 0.6, f"{path}: {elapsed:.2f} s"
    assert engine.calls == []


def test_message_and_content_caps_are_clear_400s_and_raisable() -> None:
    engine = FakeEngine(max_context=100_000)
    client = TestClient(create_app(engine, limits=RequestLimits(4, 1000)))
    r = client.post("/v1/chat/completions", json={"messages": USER * 5, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages"
    assert r.json()["error"]["param"] == "messages"
    r = client.post("/v1/chat/completions", json={"messages": USER * 4, "max_tokens": 1})
    assert r.status_code == 200
    big = [{"role": "user", "content": "y" * 1001}]
    r = client.post("/v1/chat/completions", json={"messages": big, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "content_too_large"
    assert "--max-content-chars" in r.json()["error"]["message"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "z"}] * 200}]
    r = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_content_parts"
    r = client.post("/v1/completions", json={"prompt": "p" * 1001, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post(
        "/v1/messages",
        json={"model": "fake-model", "max_tokens": 1, "system": "s" * 1001, "messages": USER},
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert len(engine.calls) == 1  # only the request within every limit ran
    raised = TestClient(create_app(FakeEngine(max_context=100_000), limits=RequestLimits(8, 2000)))
    r = raised.post("/v1/chat/completions", json={"messages": USER * 5 + big, "max_tokens": 1})
    assert r.status_code == 200


def test_a_key_over_its_share_gets_429_while_another_key_is_served() -> None:
    engine = FakeEngine(token_delay=0.02)
    client = TestClient(create_app(engine, api_keys=["a", "b"], max_requests_per_key=2))
    statuses: list[int] = []

    def long_request() -> None:
        r = client.post(
            "/v1/completions",
            json={"prompt": "slow", "max_tokens": 150, "ignore_eos": True},
            headers=bearer("a"),
        )
        statuses.append(r.status_code)

    threads = [threading.Thread(target=long_request) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while engine.active < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.active == 2
    quick = {"prompt": "quick", "max_tokens": 1}
    r = client.post("/v1/completions", json=quick, headers=bearer("a"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "key_share_exceeded"
    assert r.headers["retry-after"] == "1" and "--max-requests-per-key" in r.text
    assert engine.active == 2  # refused before it reached the engine
    anthropic = {"model": "fake-model", "max_tokens": 1, "messages": USER}
    r = client.post("/v1/messages", json=anthropic, headers={"x-api-key": "a"})
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    r = client.post("/v1/completions", json=quick, headers=bearer("b"))
    assert r.status_code == 200
    for t in threads:
        t.join()
    assert statuses == [200, 200]
    r = client.post("/v1/completions", json=quick, headers=bearer("a"))
    assert r.status_code == 200  # its share came back when its requests ended


def test_stats_show_a_key_its_own_figures_and_admins_the_server_s() -> None:
    engine = FakeEngine()
    client = TestClient(create_app(engine, api_keys=["a", "b"], admin_keys=["root"]))
    prompt = {"prompt": "a prompt long enough to span blocks", "max_tokens": 3}
    for _ in range(2):
        assert client.post("/v1/completions", json=prompt, headers=bearer("a")).status_code == 200
    r = client.post("/v1/completions", json={"prompt": "b's", "max_tokens": 2}, headers=bearer("b"))
    assert r.status_code == 200

    mine = client.get("/v1/cache/stats", headers=bearer("a")).json()
    assert mine["scope"] == "key"
    assert set(mine) == {"model", "scope", "requests"}  # no pool, tiers or namespace
    a_prompt = len(engine.tokenize(prompt["prompt"]))
    assert mine["requests"]["requests"] == 2
    assert mine["requests"]["prompt_tokens"] == 2 * a_prompt
    assert mine["requests"]["generated_tokens"] == 6
    assert 0 < mine["requests"]["cached_tokens"] < a_prompt  # the repeat hit
    theirs = client.get("/v1/cache/stats", headers=bearer("b")).json()
    assert theirs["requests"]["requests"] == 1 and theirs["requests"]["cached_tokens"] == 0
    assert theirs["requests"]["generated_tokens"] == 2

    admin = client.get("/v1/cache/stats", headers=bearer("root")).json()
    assert admin["scope"] == "server" and "tiers" in admin and "pool" in admin
    single = TestClient(create_app(FakeEngine())).get("/v1/cache/stats").json()
    assert single["scope"] == "server" and "tiers" in single


@pytest.mark.parametrize("path", ["/v1/cache/clear", "/v1/cache/stats"])
def test_admin_routes_still_need_a_valid_key(path: str) -> None:
    client = TestClient(create_app(FakeEngine(), api_keys=["a"], admin_keys=["root"]))
    method = client.post if path.endswith("clear") else client.get
    assert method(path).status_code == 401
    assert method(path, headers=bearer("nope")).status_code == 401


def test_metrics_need_a_metrics_or_admin_key_once_the_server_has_keys() -> None:
    engine = FakeEngine()
    app = create_app(engine, api_keys=["a"], admin_keys=["root"], metrics_keys=["scraper"])
    client = TestClient(app)
    # Without a key, one scrape before and one after another tenant's request would
    # give that request's prompt length and cache hit.
    assert client.post("/v1/completions", json={"prompt": "secret", "max_tokens": 2},
                       headers=bearer("a")).status_code == 200  # fmt: skip
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=bearer("nope")).status_code == 401
    r = client.get("/metrics", headers=bearer("a"))
    assert r.status_code == 403 and "--metrics-key" in r.json()["error"]["message"]
    assert "pagedkv_prompt_tokens" not in r.text
    for key in ("scraper", "root"):
        r = client.get("/metrics", headers={"x-api-key": key})
        assert r.status_code == 200 and "pagedkv_prompt_tokens_total 6.0" in r.text
    # A metrics key opens /metrics only, never the API.
    assert client.get("/v1/models", headers=bearer("scraper")).status_code == 401
    assert client.get("/health").status_code == 200  # orchestrators need no key

    no_admin = TestClient(create_app(FakeEngine(), api_keys=["a"]))
    assert no_admin.get("/metrics", headers=bearer("a")).status_code == 403
    single_user = TestClient(create_app(FakeEngine()))
    assert single_user.get("/metrics").status_code == 200
    guarded = TestClient(create_app(FakeEngine(), metrics_keys=["scraper"]))
    assert guarded.get("/metrics").status_code == 401
    assert guarded.get("/metrics", headers=bearer("scraper")).status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_description_follows_the_api_s_keys(path: str) -> None:
    client = TestClient(create_app(FakeEngine(), api_keys=["a"]))
    assert client.get(path).status_code == 401
    assert client.get(path, headers=bearer("nope")).status_code == 401
    assert client.get(path, headers=bearer("a")).status_code == 200
    assert TestClient(create_app(FakeEngine())).get(path).status_code == 200
