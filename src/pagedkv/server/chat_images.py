"""Chat rendering for a model that takes images: the one place the routes choose between
the text chat template and the processor (`Engine.render_chat`, `model/vision.py`).

Messages reach here as `prepare.chat_messages` makes them: string content, or for a
message holding images (attached by the request's image parsing) a list of
`{"type": "text", "text": ...}` and `{"type": "image", "image": ImageInput}` parts.
A model that takes images renders every conversation through its processor, with or
without images, so a text-only first turn and its next turn with an image share their
prefix. Every route that renders a conversation (the chat routes, explain, prewarm,
count_tokens, /tokenize) renders it here, so each answers for the prompt, images and
their keys included, that the chat route would run."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from pagedkv.model.vision import ImagePrompt

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
