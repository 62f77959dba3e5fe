"""A fake engine whose model takes images, for the image input tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server_fake_engine import FakeEngine

from pagedkv.model.vision import ImagePrompt


class ImageEngine(FakeEngine):
    """A fake whose model takes images; it keeps the messages each render was given."""

    takes_images = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rendered: list[list[dict[str, Any]]] = []

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], *args: Any, **kwargs: Any
    ) -> list[int]:
        self.rendered.append(list(messages))
        flat = [
            {**m, "content": "".join(p.get("text", "<image>") for p in m["content"])}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        return super().apply_chat_template(flat, *args, **kwargs)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], tools: Any = None, **kwargs: Any
    ) -> ImagePrompt:
        """As the engine's: the ids (here, of the flattened text); no spans, so the fake's
        stream is asked as for text."""
        return ImagePrompt(self.apply_chat_template(messages, tools=tools, **kwargs))


def image_parts_of(engine: ImageEngine) -> list[dict[str, Any]]:
    content = engine.rendered[-1][-1]["content"]
    assert isinstance(content, list)
    return content
