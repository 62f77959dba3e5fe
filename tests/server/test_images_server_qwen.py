"""An image through the OpenAI chat route on a real engine serving the tiny Qwen2-VL:
the answer is what the engine generates for the same conversation (its M-RoPE
positions made from the rendered spans), and a repeat hits the cache past the image.
The image part is attached by a stand-in for the request's image parsing, as in
`test_images_server.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures_vision import tiny_image
from starlette.testclient import TestClient

import pagedkv.server.app as app_module
from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.server.app import create_app


def _with_image(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last user message's text, then image 21 (40x36 pixels: a 3x4 token grid)."""
    *head, last = messages
    parts = [{"type": "text", "text": last["content"]}, {"type": "image", "image": tiny_image(21)}]
    return [*head, {**last, "content": parts}]


@pytest.fixture(scope="module")
def engine(tiny_qwen2_vl_dir: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(str(tiny_qwen2_vl_dir), config=CacheConfig(block_size=8)) as eng:
        yield eng


def test_openai_chat_with_an_image_on_qwen2_vl(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = app_module.chat_messages
    monkeypatch.setattr(app_module, "chat_messages", lambda body: _with_image(plain(body)))
    http = TestClient(create_app(engine), raise_server_exceptions=False)
    messages = [{"role": "user", "content": "What is in this picture?"}]
    fresh = engine.render_chat(_with_image(messages))
    assert fresh.images[0].rope_grid == (1, 3, 4)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    result = engine.generate(fresh.token_ids, params, images=fresh.images)
    body = {"model": engine.model_name, "messages": messages, "max_tokens": 8, "temperature": 0}
    for _ in range(2):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == engine.decode(result.token_ids)
    usage = r.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
