"""Chats about images through an engine, shared by the image tests of every family."""

from __future__ import annotations

from typing import Any, NamedTuple

from engine_helpers import GREEDY

from pagedkv import CacheConfig, Engine


def user_turn(text: str, *images: Any, after: str = " Describe it.") -> dict[str, Any]:
    """A user message: `text`, the images (`ImageInput`s), then `after`."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image", "image": image} for image in images]
    parts.append({"type": "text", "text": after})
    return {"role": "user", "content": parts}


def image_prompt(eng: Engine, *images: Any, text: str = "Here: ") -> Any:
    """One user turn about `images`, rendered by `eng` (an `ImagePrompt`)."""
    return eng.render_chat([user_turn(text, *images)])


def cache_off(**kw: Any) -> CacheConfig:
    return CacheConfig(enable_prefix_caching=False, **kw)


class ChatTurn(NamedTuple):
    answer: list[int]
    cached_tokens: int
    num_prompt: int
    image_end: int  # where the turn's last image ends in its prompt


def image_chat(eng: Engine, turns: list[dict[str, Any]]) -> list[ChatTurn]:
    """Each turn's greedy answer and what the cache gave it, the answers fed back."""
    messages: list[dict[str, Any]] = []
    out = []
    for turn in turns:
        messages.append(turn)
        prompt = eng.render_chat(messages)
        result = eng.generate(prompt.token_ids, GREEDY, images=prompt.images)
        end = prompt.images[-1].end if prompt.images else 0
        out.append(ChatTurn(result.token_ids, result.cached_tokens, len(prompt.token_ids), end))
        messages.append({"role": "assistant", "content": eng.decode(result.token_ids)})
    return out
