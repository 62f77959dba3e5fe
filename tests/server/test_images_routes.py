"""The routes that look at a prompt without generating, with images, on a real engine
serving the tiny LLaVA (in-process): explain (both APIs) looks the request's image keys
up as the chat route does, so its `cached_tokens` is what the request then reuses and
another image at the same place is `image_changed`; prewarm stores the image prompt the
chat route then reuses whole; count_tokens and /tokenize count each image's
placeholder tokens as the chat route's usage does. Images are sent as data URLs."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures_vision import IMAGE_TOKENS
from image_files import b64, data_url, encode, pixels
from starlette.testclient import TestClient

from pagedkv import CacheConfig, Engine
from pagedkv.server.app import create_app

ANTHROPIC = {"anthropic-version": "2023-06-01"}


def png(seed: int) -> bytes:
    return encode(pixels((40, 36), seed=seed), "PNG")


def chat(text: str, *seeds: int) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(png(s))}} for s in seeds]
    return [{"role": "user", "content": parts}]


def anthropic(text: str, *seeds: int) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}]
    blocks += [
        {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": b64(png(s))},
        }
        for s in seeds
    ]
    return [{"role": "user", "content": blocks}]


@pytest.fixture(scope="module")
def http(tiny_llava_dir: Path) -> Iterator[TestClient]:
    with Engine.from_pretrained(str(tiny_llava_dir), config=CacheConfig(block_size=8)) as eng:
        yield TestClient(create_app(eng), raise_server_exceptions=False)


def post(http: TestClient, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    r = http.post(path, json=body, **kw)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def generate(http: TestClient, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 4, "temperature": 0}
    usage: dict[str, Any] = post(http, "/v1/chat/completions", body)["usage"]
    return usage


def test_explain_with_images_is_what_the_request_reuses(http: TestClient) -> None:
    messages = chat("Explain this picture: ", 60, 61)
    first = post(http, "/v1/cache/explain", {"messages": messages})
    assert first["miss"]["reason"] == "new"
    usage = generate(http, messages)
    assert usage["prompt_tokens"] == first["prompt_tokens"]
    again = post(http, "/v1/cache/explain", {"messages": messages})
    assert again["miss"] is None and again["cached_tokens"] == first["prompt_tokens"] - 1
    assert (
        generate(http, messages)["prompt_tokens_details"]["cached_tokens"]
        == (again["cached_tokens"])
    )
    # the second image replaced: explain names it and says what the request then reuses
    other = chat("Explain this picture: ", 60, 62)
    changed = post(http, "/v1/cache/explain", {"messages": other})
    assert changed["miss"]["reason"] == "image_changed", changed
    assert "image 1 " in changed["miss"]["detail"]
    assert changed["miss"]["section"] == {"kind": "message", "message_index": 0, "role": "user"}
    got = generate(http, other)["prompt_tokens_details"]["cached_tokens"]
    assert got == changed["cached_tokens"] < again["cached_tokens"]
    # the Anthropic form of the same request: the same prompt, the same answer
    same = anthropic("Explain this picture: ", 60, 61)
    body = {"model": "model", "max_tokens": 4, "messages": same}
    r = post(http, "/v1/messages/explain", body)
    assert (r["prompt_tokens"], r["cached_tokens"]) == (
        again["prompt_tokens"],
        again["cached_tokens"],
    )


def test_prewarm_with_images_then_the_request_reuses_it(http: TestClient) -> None:
    messages = chat("Prewarm this: ", 63)
    stored = post(http, "/v1/cache/prewarm", {"messages": messages})
    assert stored["cached_tokens"] < IMAGE_TOKENS < stored["stored_tokens"]
    usage = generate(http, messages)
    assert usage["prompt_tokens"] == stored["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    body = {"model": "model", "max_tokens": 4, "messages": anthropic("Prewarm that: ", 64)}
    r = post(http, "/v1/cache/prewarm", body, headers=ANTHROPIC)
    assert r["stored_tokens"] > IMAGE_TOKENS


def test_count_tokens_and_tokenize_count_the_image_tokens(http: TestClient) -> None:
    messages = chat("Count this: ", 65, 66)
    usage = generate(http, messages)
    text_only = post(http, "/tokenize", {"messages": chat("Count this: ")})
    tokens = post(http, "/tokenize", {"messages": messages})
    assert tokens["count"] == usage["prompt_tokens"] == len(tokens["tokens"])
    assert tokens["count"] == text_only["count"] + 2 * IMAGE_TOKENS
    body = {"model": "model", "messages": anthropic("Count this: ", 65, 66)}
    counted = post(http, "/v1/messages/count_tokens", body)
    sent = post(http, "/v1/messages", {**body, "max_tokens": 4, "temperature": 0})
    assert counted["input_tokens"] == sent["usage"]["input_tokens"] + sent["usage"].get(
        "cache_read_input_tokens", 0
    )


def test_no_decoded_pixels_outlive_the_requests(http: TestClient) -> None:
    """Run last in this file: every route above dropped its images' pixels, so the
    server-wide budget (`--max-image-memory-bytes`) is whole again."""
    gc.collect()
    memory = http.app.state.pagedkv.image_memory  # type: ignore[attr-defined]
    assert memory.in_use_bytes == 0 and memory.refused == 0
