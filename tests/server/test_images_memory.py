"""The server-wide budget of decoded image pixels (`--max-image-memory-bytes`): an image
reserves its RGB size before decoding and gives it back when its pixels are freed; a
request past the budget gets 503 image_memory_full with Retry-After, an image that could
never fit a 400; the server answers the next request once the pixels are gone."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from image_engine import ImageEngine
from image_files import data_url, encode, pixels
from starlette.testclient import TestClient

from pagedkv.server.app import create_app
from pagedkv.server.http_errors import APIError
from pagedkv.server.images import ImageLimits, ImageMemory, decode_image

SIZE = (16, 12)
ONE = 3 * SIZE[0] * SIZE[1]  # one image's decoded RGB bytes


def body(*seeds: int) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "look"}]
    parts += [
        {"type": "image_url", "image_url": {"url": data_url(encode(pixels(SIZE, s), "PNG"))}}
        for s in seeds
    ]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}


def test_reservations_are_bounded_and_follow_the_pixels() -> None:
    memory = ImageMemory(2 * ONE)
    png = encode(pixels(SIZE, 1), "PNG")
    a = decode_image(png, ImageLimits(), "a", memory)
    b = decode_image(png, ImageLimits(), "b", memory)
    assert memory.in_use_bytes == 2 * ONE
    with pytest.raises(APIError) as full:
        decode_image(png, ImageLimits(), "c", memory)
    assert full.value.status == 503 and full.value.code == "image_memory_full"
    assert full.value.headers["Retry-After"] and full.value.param == "c"
    assert memory.in_use_bytes == 2 * ONE and memory.refused == 1
    del a
    gc.collect()
    assert memory.in_use_bytes == ONE
    c = decode_image(png, ImageLimits(), "c", memory)
    del b, c
    gc.collect()
    assert memory.in_use_bytes == 0
    with pytest.raises(APIError) as never:
        decode_image(encode(pixels((40, 40), 2), "PNG"), ImageLimits(), "d", ImageMemory(ONE))
    assert never.value.status == 400 and "--max-image-memory-bytes" in never.value.message
    # a decode that fails gives its reservation back
    with pytest.raises(APIError):
        decode_image(png[:60], ImageLimits(), "e", memory)
    assert memory.in_use_bytes == 0


def test_requests_past_the_budget_get_503_and_the_server_recovers() -> None:
    engine = ImageEngine()
    app = create_app(engine, images=ImageLimits(max_memory_bytes=2 * ONE))
    memory = app.state.pagedkv.image_memory
    c = TestClient(app, raise_server_exceptions=False)
    r = c.post("/v1/chat/completions", json=body(1, 2, 3))
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "image_memory_full" and "messages[0].content[3]" in error["param"]
    assert r.headers["retry-after"]
    gc.collect()
    assert memory.in_use_bytes == 0  # the refused request's first two images are freed
    for route in ("/v1/chat/completions", "/tokenize"):
        payload = body(4, 5) if route != "/tokenize" else {"messages": body(4, 5)["messages"]}
        r = c.post(route, json=payload)
        assert r.status_code == 200, (route, r.text)
        engine.rendered.clear()  # the fake keeps what it rendered; the server does not
        gc.collect()
        assert memory.in_use_bytes == 0, route


def test_refusals_in_a_row_collect_garbage_at_most_once_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client sending image after image into a full budget must not make the server
    collect its whole heap on each one."""
    from pagedkv.server.images import budget

    collections = []
    monkeypatch.setattr(budget.gc, "collect", lambda: collections.append(1))
    memory = ImageMemory(ONE)
    held = memory.reserve(ONE, "held")
    for _ in range(20):
        with pytest.raises(APIError):
            memory.reserve(ONE, "more")
    assert len(collections) == 1 and memory.refused == 20
    memory._collected -= budget.COLLECT_EVERY_S  # a second later
    with pytest.raises(APIError):
        memory.reserve(ONE, "more")
    assert len(collections) == 2
    held.release()
