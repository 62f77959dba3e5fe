"""Text that a library or the engine's internals wrote never reaches a client: it gets a
generic message with the request id (also its `x-request-id` header), and the log gets the
detail under that id. Messages pagedkv wrote (typed refusals, a template's own
raise_exception) reach the client unchanged."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest
import uvicorn
from jinja2.exceptions import TemplateError, UndefinedError
from server_fake_engine import FakeEngine
from starlette.testclient import TestClient

from pagedkv.errors import EngineClosedError, EngineOverloadedError
from pagedkv.server.app import create_app
from pagedkv.server.serve import server_config

SECRET = "Overflow when unpacking long long at 0x7f3a secret-internal-detail"
USER = [{"role": "user", "content": "hi"}]


class Raising(FakeEngine):
    """A fake engine whose tokenizer, chat template or stream raises `error`."""

    def __init__(self, error: BaseException, where: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.error = error
        self.where = where

    def tokenize(self, text: str, max_tokens: int | None = None) -> list[int]:
        if self.where == "tokenize":
            raise self.error
        return super().tokenize(text)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        if self.where == "template":
            raise self.error
        return super().apply_chat_template(messages, tools, **kwargs)

    def stream(
        self, prompt: Any, params: Any = None, *, cache_salt: Any = None, owner: Any = None
    ) -> Iterator[Any]:
        if self.where == "submit":
            raise self.error
        inner = super().stream(prompt, params, cache_salt=cache_salt, owner=owner)
        if self.where != "mid-stream":
            return inner

        def broken() -> Iterator[Any]:
            yield next(inner)
            inner.close()
            raise self.error

        return broken()


def request_id_of(r: httpx.Response) -> str:
    request_id = r.headers["x-request-id"]
    assert request_id.startswith("req_") and len(request_id) > 20
    return request_id


def assert_hidden(r: httpx.Response, caplog: pytest.LogCaptureFixture, status: int) -> str:
    assert r.status_code == status, r.text
    assert SECRET not in r.text and "secret-internal" not in r.text
    request_id = request_id_of(r)
    assert request_id in r.text
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged, "the detail was not logged under the request id"
    assert any(
        SECRET in rec.getMessage() or (rec.exc_info and SECRET in str(rec.exc_info[1]))
        for rec in logged
    )
    return r.text


@pytest.mark.parametrize(
    ("where", "error", "status"),
    [
        ("tokenize", ValueError(SECRET), 400),
        ("tokenize", IndexError(SECRET), 400),
        ("tokenize", RuntimeError(SECRET), 500),
        ("template", KeyError(SECRET), 400),
        ("template", UndefinedError(SECRET), 400),
        ("submit", ValueError(SECRET), 400),
        ("submit", TypeError(SECRET), 400),
        ("submit", EngineClosedError(f"the engine's worker died (RuntimeError: {SECRET})"), 503),
        ("submit", RuntimeError(SECRET), 500),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_foreign_error_text_is_logged_not_sent(
    where: str, error: BaseException, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    client = TestClient(create_app(Raising(error, where)), raise_server_exceptions=False)
    caplog.set_level(logging.INFO, logger="pagedkv")
    if where == "tokenize":
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    else:
        r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
    body = assert_hidden(r, caplog, status)
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}

    caplog.clear()
    anthropic = {"model": "fake-model", "messages": USER, "max_tokens": 2}
    r = client.post("/v1/messages", json=anthropic)
    assert_hidden(r, caplog, status)
    assert r.json()["type"] == "error"  # Anthropic's shape there


def test_an_error_mid_stream_is_hidden_in_the_event(caplog: pytest.LogCaptureFixture) -> None:
    client = TestClient(create_app(Raising(RuntimeError(SECRET), "mid-stream")))
    caplog.set_level(logging.INFO, logger="pagedkv")
    r = client.post(
        "/v1/chat/completions", json={"messages": USER, "max_tokens": 5, "stream": True}
    )
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert "internal error: RuntimeError" in r.text
    assert_hidden(r, caplog, 200)


def test_our_own_refusals_keep_their_words() -> None:
    overloaded = Raising(EngineOverloadedError(64, 64), "submit")
    r = TestClient(create_app(overloaded)).post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 429
    assert "the engine has 64 requests queued (limit 64)" in r.json()["error"]["message"]
    assert r.headers["x-request-id"].startswith("req_")

    alternate = TemplateError("Conversation roles must alternate user/assistant/user")
    r = TestClient(create_app(Raising(alternate, "template"))).post(
        "/v1/chat/completions", json={"messages": USER}
    )
    assert r.status_code == 400  # the template's raise_exception(): its author's words
    assert "Conversation roles must alternate" in r.json()["error"]["message"]


def test_every_response_has_its_own_request_id() -> None:
    client = TestClient(create_app(FakeEngine()))
    ids = {client.get("/health").headers["x-request-id"] for _ in range(3)}
    ids.add(client.get("/nope").headers["x-request-id"])
    assert len(ids) == 4


def test_a_500_s_traceback_is_logged_once_under_uvicorn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Starlette re-raised every unhandled exception to uvicorn after answering, which
    logged the same traceback a second time (625 KB twice for a deep RecursionError)."""
    uvicorn_records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            uvicorn_records.append(record)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    app = create_app(Raising(RuntimeError(SECRET), "tokenize"))
    server = uvicorn.Server(server_config(app, log_level="warning"))
    handler = Keep()
    logging.getLogger("uvicorn.error").addHandler(handler)
    caplog.set_level(logging.INFO, logger="pagedkv")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi"}, timeout=5.0)
        assert_hidden(r, caplog, 500)
        time.sleep(0.2)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        logging.getLogger("uvicorn.error").removeHandler(handler)
    tracebacks = [
        rec
        for rec in caplog.records + uvicorn_records
        if rec.exc_info or "Traceback" in rec.getMessage()
    ]
    assert len(tracebacks) == 1, [rec.getMessage() for rec in tracebacks]
