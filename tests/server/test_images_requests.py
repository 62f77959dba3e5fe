"""Images in chat requests through the app (in-process, fake engine): every refusal is a
400 naming the client's own field, in each API's error shape, and the server answers
the next request; a model that takes images gets text and image parts in order."""

from __future__ import annotations

from typing import Any

import pytest
from image_engine import ImageEngine, image_parts_of
from image_files import animated, b64, data_url, encode, pixels, png_header_claiming
from server_fake_engine import FakeEngine
from starlette.testclient import TestClient

from pagedkv.model.images import ImageInput, image_from_pixels
from pagedkv.server.app import create_app
from pagedkv.server.chat_images import takes_images
from pagedkv.server.images import ImageLimits, decode_image

PNG = encode(pixels(), "PNG")
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def client(engine: FakeEngine | None = None, **limits: Any) -> TestClient:
    app = create_app(engine or FakeEngine(), images=ImageLimits(**limits))
    return TestClient(app, raise_server_exceptions=False)


def openai_parts(*parts: dict[str, Any], role: str = "user") -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": "s"}, {"role": role, "content": list(parts)}]
    }


def image_url(url: str, **more: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **more}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def anthropic_image(data: str, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def messages_body(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "max_tokens": 4,
        "system": "s",
        "messages": [{"role": "user", "content": list(blocks)}],
    }


def assert_answers(c: TestClient) -> None:
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


WHERE = "messages[1].content[1].image_url.url"
OPENAI_CASES: list[tuple[dict[str, Any], str, str]] = [
    (image_url(data_url(PNG[: len(PNG) // 2])), WHERE, "could not be decoded"),
    (image_url(data_url(png_header_claiming(100_000, 100_000))), WHERE, "pixels"),
    (image_url(data_url(encode(pixels(), "GIF"), "image/gif")), WHERE, "GIF images"),
    (image_url(data_url(encode(pixels(), "BMP"))), WHERE, "BMP images"),
    (image_url(data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>")), WHERE, "SVG images"),
    (image_url(data_url(animated("WEBP"), "image/webp")), WHERE, "animated"),
    (image_url("data:image/png;base64,@@@@"), WHERE, "not valid base64"),
    (image_url("data:image/png," + b64(PNG)), WHERE, "';base64'"),
    (image_url("ftp://example.com/cat.png"), WHERE, "'ftp'"),
    (image_url("file:///etc/passwd"), WHERE, "local files are never read"),
    (image_url("http://example.com/cat.png"), WHERE, "--allow-remote-images"),
    (image_url(data_url(PNG), detail="low"), "messages[1].content[1].image_url.detail", "'low'"),
    (image_url(data_url(PNG), detail="high"), "messages[1].content[1].image_url.detail", "'high'"),
    ({"type": "image_url"}, "messages[1].content[1].image_url", "needs 'image_url'"),
    ({"type": "image_url", "image_url": {}}, "messages[1].content[1].image_url.url", ""),
    ({"type": "input_audio"}, "messages[1].content[1].type", "'input_audio'"),
]


@pytest.mark.parametrize("engine", [FakeEngine, ImageEngine])
def test_openai_image_refusals_name_the_field_and_the_server_answers_after(
    engine: type[FakeEngine],
) -> None:
    c = client(engine())
    for part, param, fragment in OPENAI_CASES:
        r = c.post("/v1/chat/completions", json=openai_parts(text("look"), part))
        assert r.status_code == 400, (param, r.text)
        error = r.json()["error"]
        assert error["param"] == param and fragment in error["message"], (param, error)
    assert_answers(c)


def test_images_only_in_user_messages_and_at_most_max_images() -> None:
    c = client(ImageEngine(), max_images=2)
    r = c.post(
        "/v1/chat/completions", json=openai_parts(image_url(data_url(PNG)), role="assistant")
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content[0].type"
    three = [image_url(data_url(PNG))] * 3
    r = c.post("/v1/chat/completions", json=openai_parts(*three))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages"
    assert error["code"] == "too_many_images" and "--max-images-per-request" in error["message"]
    assert c.post("/v1/chat/completions", json=openai_parts(*three[:2])).status_code == 200


def test_the_byte_cap_is_checked_on_the_base64_before_decoding() -> None:
    body = openai_parts(image_url(data_url(PNG)))
    r = client(ImageEngine(), max_bytes=len(PNG) // 2).post("/v1/chat/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages[1].content[0].image_url.url"
    assert "base64 characters" in error["message"] and "--max-image-bytes" in error["message"]
    # Within base64's padding of the cap: the decoded bytes are checked too.
    r = client(ImageEngine(), max_bytes=len(PNG) - 1).post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and f"{len(PNG)} bytes, over" in r.json()["error"]["message"]


def test_a_model_without_images_refuses_them_after_checking_them() -> None:
    assert not takes_images(FakeEngine()) and takes_images(ImageEngine())
    c = client()
    r = c.post("/v1/chat/completions", json=openai_parts(text("a"), image_url(data_url(PNG))))
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "messages[1].content[1].image_url.url"
    assert "the served model fake-model does not take images" in error["message"]
    assert error["code"] == "images_not_supported"
    r = c.post("/v1/messages", json=messages_body(anthropic_image(b64(PNG))), headers=ANTHROPIC)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "does not take images" in r.json()["error"]["message"]
    assert_answers(c)


def test_a_model_that_takes_images_gets_text_and_image_parts_in_the_clients_order() -> None:
    engine = ImageEngine()
    c = client(engine)
    red, blue = pixels(seed=3), pixels((9, 7), seed=4)
    body = openai_parts(
        text("first"),
        image_url(data_url(encode(red, "PNG"))),
        text("second"),
        image_url(data_url(encode(blue, "WEBP", lossless=True), "image/webp"), detail="auto"),
    )
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    parts = image_parts_of(engine)
    assert [p["type"] for p in parts] == ["text", "image", "text", "image"]
    assert parts[0]["text"] == "first" and parts[2]["text"] == "second"
    assert isinstance(parts[1]["image"], ImageInput)
    assert parts[1]["image"].digest == image_from_pixels(red).digest
    assert parts[3]["image"].digest == image_from_pixels(blue).digest
    assert engine.rendered[-1][0] == {"role": "system", "content": "s"}  # text stays a string

    blocks = [
        text("first"),
        anthropic_image(b64(encode(red, "PNG"))),
        text("second"),
        anthropic_image(b64(encode(blue, "WEBP", lossless=True)), "image/webp"),
    ]
    r = c.post("/v1/messages", json=messages_body(*blocks), headers=ANTHROPIC)
    assert r.status_code == 200, r.text
    same = image_parts_of(engine)
    assert [p.get("text") for p in same] == [p.get("text") for p in parts]
    assert [p["image"].digest for p in same[1::2]] == [p["image"].digest for p in parts[1::2]]


def test_text_only_content_renders_as_before() -> None:
    engine = ImageEngine()
    c = client(engine)
    parts = [text("one"), text("two")]
    for body in (
        openai_parts(*parts),
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "one\ntwo"}]},
    ):
        assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.rendered[-1] == engine.rendered[-2]
    assert engine.rendered[-1][-1] == {"role": "user", "content": "one\ntwo"}
    assert engine.calls[-1]["ids"] == engine.calls[-2]["ids"]
    r = c.post("/v1/messages", json=messages_body(*parts), headers=ANTHROPIC)
    assert r.status_code == 200 and engine.rendered[-1][-1] == {
        "role": "user",
        "content": "one\ntwo",
    }


ANTHROPIC_CASES: list[tuple[dict[str, Any], str, str]] = [
    (anthropic_image(b64(PNG[:100])), "messages[0].content[1].source.data", "could not be decoded"),
    (
        anthropic_image(b64(encode(pixels(), "GIF"))),
        "messages[0].content[1].source.data",
        "GIF images",
    ),
    (anthropic_image("@@@@"), "messages[0].content[1].source.data", "not valid base64"),
    (
        anthropic_image(b64(PNG), "image/gif"),
        "messages[0].content[1].source.media_type",
        "'image/gif'",
    ),
    (anthropic_image(""), "messages[0].content[1].source", "needs 'data'"),
    ({"type": "image"}, "messages[0].content[1]", "needs 'source'"),
    (
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        "messages[0].content[1].source.url",
        "--allow-remote-images",
    ),
    (
        {"type": "image", "source": {"type": "url", "url": "file:///etc/passwd"}},
        "messages[0].content[1].source.url",
        "never read",
    ),
    (
        {"type": "image", "source": {"type": "file", "file_id": "f"}},
        "messages[0].content[1].source.type",
        "'file'",
    ),
]


def test_anthropic_image_refusals_name_the_field_in_anthropics_shape() -> None:
    c = client(ImageEngine())
    for block, param, fragment in ANTHROPIC_CASES:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = c.post(path, json=messages_body(text("look"), block), headers=ANTHROPIC)
            assert r.status_code == 400, (param, r.text)
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert body["error"]["message"].startswith(param + ":"), (param, body)
            assert fragment in body["error"]["message"], (fragment, body)
    ok = messages_body(text("look"), anthropic_image(b64(PNG)))
    assert c.post("/v1/messages/count_tokens", json=ok, headers=ANTHROPIC).status_code == 200
    assert c.post("/v1/messages", json=ok, headers=ANTHROPIC).status_code == 200
    assert_answers(c)


def test_explain_and_tokenize_check_and_render_images() -> None:
    engine = ImageEngine()
    c = client(engine)
    body = openai_parts(text("look"), image_url(data_url(PNG)))
    bad = openai_parts(text("look"), image_url(data_url(encode(pixels(), "GIF"))))
    for path in ("/v1/cache/explain", "/tokenize"):
        r = c.post(path, json=bad)
        assert r.status_code == 400 and "GIF" in r.json()["error"]["message"], path
        assert r.json()["error"]["param"] == "messages[1].content[1].image_url.url"
    r = c.post("/tokenize", json=body)  # rendered as the chat route renders it
    assert r.status_code == 200, r.text
    parts = image_parts_of(engine)
    assert [p["type"] for p in parts] == ["text", "image"]
    assert isinstance(parts[1]["image"], ImageInput)


def test_the_image_flags_defaults_are_image_limits_defaults() -> None:
    from pagedkv.cli import build_parser
    from pagedkv.flags import image_limits_from_args

    args = build_parser().parse_args(["serve"])
    assert image_limits_from_args(args) == ImageLimits()
    args = build_parser().parse_args(["serve", "--allow-remote-images", "--max-image-pixels", "99"])
    limits = image_limits_from_args(args)
    assert limits.allow_remote and limits.max_pixels == 99
    with pytest.raises(ValueError, match="--max-image-side 0"):
        ImageLimits(max_side=0)


def test_attach_images_decodes_on_the_render_pool_and_keeps_pixels_only_when_asked() -> None:
    import asyncio
    import threading

    from pagedkv.server.images import attach_images
    from pagedkv.server.protocol import ChatCompletionRequest
    from pagedkv.server.render_pool import RenderPool

    threads: list[str] = []

    class Pool(RenderPool):
        async def run(self, owner: str | None, fn: Any, *args: object) -> Any:
            def on_thread(*inner: object) -> Any:
                threads.append(threading.current_thread().name)
                return fn(*inner)

            return await super().run(owner, on_thread, *args)

    pool = Pool(2)
    try:
        for keep in (False, True):
            body = ChatCompletionRequest.model_validate(openai_parts(image_url(data_url(PNG))))
            found = asyncio.run(attach_images(body, ImageLimits(), pool, "key", keep=keep))
            assert found == ["messages[1].content[0].image_url.url"]
            part = body.messages[1].content[0]  # type: ignore[index]
            assert (part.image is not None) is keep
        assert len(threads) == 2 and all(t.startswith("pagedkv-render") for t in threads)
    finally:
        pool.close()


def test_drift_digests_name_an_image_by_its_pixels() -> None:
    from pagedkv.server.drift import message_digests

    def message(data: bytes) -> list[dict[str, Any]]:
        image = decode_image(data, ImageLimits(), "p")  # a new object each time
        return [{"role": "user", "content": [text("a"), {"type": "image", "image": image}]}]

    png, webp = encode(pixels(), "PNG"), encode(pixels(), "WEBP", lossless=True)
    assert message_digests(message(png), None) == message_digests(message(webp), None)
    other = encode(pixels(seed=9), "PNG")
    assert message_digests(message(png), None)[1] != message_digests(message(other), None)[1]
