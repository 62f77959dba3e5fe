"""Chat rendering for a model that takes images: the one place the routes choose between
the text chat template and the processor (`Engine.render_chat`, `model/vision.py`).

Messages reach here as `prepare.chat_messages` makes them: string content, or for a
message holding images (attached by the request's image parsing) a list of
`{"type": "text", "text": ...}` and `{"type": "image", "image": ImageInput}` parts.
A model that takes images renders every conversation through its processor, with or
without images, so a text-only first turn and its next turn with an image share their
prefix. A route that cannot carry images to the engine yet (explain, prewarm,
count_tokens, /tokenize) refuses them with a 400 rather than answer for another prompt."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.model.vision import ImagePrompt
from pagedkv.server.http_errors import bad_request

Messages = list[dict[str, Any]]


def takes_images(engine: object) -> bool:
    """Whether the served model renders images (`Engine.takes_images`); an engine double
    without the attribute takes none."""
    return getattr(engine, "takes_images", False) is True


def chat_renderer(
    engine: Any, tools: Sequence[dict[str, Any]] | None, max_tokens: int
) -> Callable[[Messages], ImagePrompt]:
    """Messages -> the prompt: through `render_chat` for a model that takes images, else
    the chat template (whose ids carry no images)."""
    if takes_images(engine):
        return functools.partial(engine.render_chat, tools=tools, max_tokens=max_tokens)
    template = functools.partial(engine.apply_chat_template, tools=tools, max_tokens=max_tokens)
    return lambda messages: ImagePrompt(list(template(messages)))


def template_ids(engine: Any) -> Callable[[Sequence[dict[str, Any]], Any], list[int]]:
    """(messages, tools) -> ids, as the breakpoints' prefix renders need: image
    placeholders expanded as the request's own prompt has them."""
    if takes_images(engine):
        return lambda messages, tools: list(engine.render_chat(messages, tools).token_ids)
    render: Callable[[Sequence[dict[str, Any]], Any], list[int]] = engine.apply_chat_template
    return render


def text_only(prompt: ImagePrompt, route: str) -> list[int]:
    """The prompt's ids, or a 400 when it holds images that `route` cannot carry."""
    if prompt.images:
        raise bad_request(
            f"messages: {route} does not take images yet; send the conversation "
            "without its image parts, or to /v1/chat/completions or /v1/messages",
            "messages",
            code="images_not_supported",
        )
    return prompt.token_ids
