"""A fake engine whose model takes images, for the image input tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from server_fake_engine import FakeEngine


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


def image_parts_of(engine: ImageEngine) -> list[dict[str, Any]]:
    content = engine.rendered[-1][-1]["content"]
    assert isinstance(content, list)
    return content
