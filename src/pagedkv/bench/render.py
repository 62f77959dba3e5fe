"""Prompt ids of a workload's message lists, as the model under test would see them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.bench.workloads import Message
from pagedkv.errors import ModelNotSupportedError


class Renderer:
    """Prompt ids of a message list: the model's chat template, or, for a model
    without one, a plain `role: content` transcript (noted in the results)."""

    def __init__(
        self,
        apply_chat_template: Callable[[list[Message]], list[int]],
        encode: Callable[[str], list[int]],
    ) -> None:
        self._template = apply_chat_template
        self._encode = encode
        self.kind = "chat template"

    def __call__(self, messages: Sequence[Message]) -> list[int]:
        if self.kind == "chat template":
            try:
                return self._template(list(messages))
            except ModelNotSupportedError:
                self.kind = "plain transcript (the model has no chat template)"
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self._encode(text + "assistant:")
