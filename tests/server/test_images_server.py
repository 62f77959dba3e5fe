"""Images through the chat routes, on a real engine serving the tiny LLaVA: the OpenAI and
Anthropic routes render image parts through the processor and generate what the engine
generates for the same conversation; a repeat hits the cache past the image; the vision
cache's figures are served (explain, prewarm and the counting routes with images:
`test_images_routes.py`).

The image parts are attached here by a stand-in for the request's image parsing (the
input side, `server/images/`): text `[img N]` in a user message becomes image N."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fixtures_vision import tiny_image
from starlette.testclient import TestClient

import pagedkv.server.app as app_module
from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.server.app import create_app

_MARK = re.compile(r"\[img (\d+)\]")


def _with_images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and _MARK.search(content):
            parts: list[dict[str, Any]] = []
            for k, piece in enumerate(_MARK.split(content)):
                if k % 2:
                    parts.append({"type": "image", "image": tiny_image(int(piece))})
                elif piece:
                    parts.append({"type": "text", "text": piece})
            message = {**message, "content": parts}
        out.append(message)
    return out


@pytest.fixture(scope="module")
def engine(tiny_llava_dir: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(str(tiny_llava_dir), config=CacheConfig(block_size=8)) as eng:
        yield eng


@pytest.fixture
def http(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    plain = app_module.chat_messages
    monkeypatch.setattr(app_module, "chat_messages", lambda body: _with_images(plain(body)))
    return TestClient(create_app(engine), raise_server_exceptions=False)


def _direct(engine: Engine, messages: list[dict[str, Any]]) -> str:
    prompt = engine.render_chat(_with_images(messages))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    return engine.decode(engine.generate(prompt.token_ids, params, images=prompt.images).token_ids)


USER = [{"role": "user", "content": "What is in [img 21] here?"}]


def test_openai_chat_with_an_image_generates_as_the_engine_and_hits_the_cache(
    engine: Engine, http: TestClient
) -> None:
    want = _direct(engine, USER)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
    first = client.chat.completions.create(
        model=engine.model_name,
        messages=USER,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert first.choices[0].message.content == want
    again = client.chat.completions.create(
        model=engine.model_name,
        messages=USER,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert again.choices[0].message.content == want
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    other = [{"role": "user", "content": "What is in [img 22] here?"}]
    moved = client.chat.completions.create(
        model=engine.model_name,
        messages=other,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert moved.choices[0].message.content == _direct(engine, other)
    stats = http.get("/v1/cache/stats").json()["vision_cache"]
    assert stats["encoder_calls"] >= 2 and stats["bytes"] > 0
    assert "pagedkv_vision_cache_hits_total" in http.get("/metrics").text


def test_anthropic_messages_with_an_image(engine: Engine, http: TestClient) -> None:
    body = {"model": engine.model_name, "max_tokens": 8, "temperature": 0, "messages": USER}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == _direct(engine, USER)
