"""A chat request's images: found, counted, fetched or decoded, and attached to their parts.

Both APIs meet here: an Anthropic `image` block becomes an OpenAI `image_url`
part when the request is converted (`anthropic/convert.py`), keeping the name of
the field the client sent (`source.data`, `source.url`) for its errors. The
route calls `attach_images` once, before the prompt is rendered; every image is
checked and decoded there (hostile bytes get their own 400 even on a model that
takes no images), and `chat_messages` then turns a message holding images into
the content parts the model side renders (`image_content`). A message without
images keeps its plain string content: the text path is unchanged.
"""

from __future__ import annotations

from typing import Any

from pagedkv.model.images import ImageInput
from pagedkv.server.http_errors import bad_request
from pagedkv.server.images.budget import ImageMemory
from pagedkv.server.images.decode import decode_image
from pagedkv.server.images.fetch import fetch_image
from pagedkv.server.images.limits import ImageLimits
from pagedkv.server.images.source import InlineImage, decode_base64, image_source
from pagedkv.server.protocol import ChatCompletionRequest, ContentPart
from pagedkv.server.render_pool import RenderPool

IMAGE_PART = "image_url"


def part_param(part: ContentPart, i: int, j: int) -> str:
    """The field holding the image's URL or data, as the client sent it."""
    return part.source_param or f"messages[{i}].content[{j}].image_url.url"


def image_parts(body: ChatCompletionRequest, limits: ImageLimits) -> list[tuple[ContentPart, str]]:
    """Every image part of `body` in order, with its field's name; the parts' own fields
    checked (role, `image_url`, `detail`) and their number against `limits`."""
    found: list[tuple[ContentPart, str]] = []
    for i, msg in enumerate(body.messages):
        if not isinstance(msg.content, list):
            continue
        for j, part in enumerate(msg.content):
            if part.type != IMAGE_PART:
                continue
            where = f"messages[{i}].content[{j}]"
            if msg.role != "user":
                raise bad_request(
                    f"{where}: images are taken in user messages only, not in a "
                    f"{msg.role!r} message",
                    f"{where}.type",
                )
            if part.image_url is None or part.image_url.url is None:
                field = "image_url" if part.image_url is None else "image_url.url"
                raise bad_request(
                    f"{where}: an image_url part needs 'image_url': {{'url': ...}}",
                    f"{where}.{field}",
                )
            detail = part.image_url.detail
            if detail not in (None, "auto"):
                raise bad_request(
                    f"{where}.image_url.detail: {detail!r} is not served: the model's "
                    "processor sizes every image itself; send 'auto' or leave it out",
                    f"{where}.image_url.detail",
                )
            found.append((part, part_param(part, i, j)))
    if len(found) > limits.max_images:
        raise bad_request(
            f"the request has {len(found)} images; this server takes at most "
            f"{limits.max_images} per request (the operator can raise "
            "--max-images-per-request)",
            "messages",
            code="too_many_images",
        )
    return found


async def attach_images(
    body: ChatCompletionRequest,
    limits: ImageLimits,
    pool: RenderPool,
    owner: str | None,
    keep: bool = True,
    memory: ImageMemory | None = None,
) -> list[str]:
    """Decode every image of `body` (fetching remote ones when allowed) and attach it to
    its part; returns the images' field names, in order. Decoding runs on the render
    pool, fairly between keys; a part already attached (a second call) is kept.
    `keep=False` checks the images without keeping their pixels (a model that takes
    none refuses them next: a request of eight small PNGs of 16 MP each would
    otherwise hold 384 MiB while it waits for its refusal). `memory`: the server's
    budget of decoded pixels in flight (`budget.ImageMemory`; None: unbounded)."""
    found = image_parts(body, limits)
    for part, param in found:
        if part.image is not None:
            continue
        assert part.image_url is not None and part.image_url.url is not None  # checked
        source = image_source(part.image_url.url, limits, param)
        if isinstance(source, InlineImage):
            image = await pool.run(owner, _decode_inline, source, limits, param, memory)
        else:
            data = await fetch_image(source.url, limits, param)
            image = await pool.run(owner, decode_image, data, limits, param, memory)
        if keep:
            part.image = image
        del image
    return [param for _, param in found]


def _decode_inline(
    source: InlineImage, limits: ImageLimits, param: str, memory: ImageMemory | None
) -> ImageInput:
    return decode_image(decode_base64(source.base64, param), limits, param, memory)


def image_content(parts: list[ContentPart], i: int) -> list[dict[str, Any]]:
    """A message's content parts as the model side renders them, in the client's order:
    `{"type": "text", "text": str}` and `{"type": "image", "image": ImageInput}`."""
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        if part.type == "text":
            if part.text is None:
                raise bad_request(f"{where}: a text part needs 'text'", f"{where}.text")
            out.append({"type": "text", "text": part.text})
        elif part.type == IMAGE_PART:
            if part.image is None:  # not decoded: a caller that skipped attach_images
                raise bad_request(
                    f"{where}: this route does not take images", part_param(part, i, j)
                )
            out.append({"type": "image", "image": part.image})
        else:
            raise bad_request(
                f"{where}: content parts of type {part.type!r} are not supported; "
                "send 'text' or 'image_url'",
                f"{where}.type",
            )
    return out
