"""Reasoning-aware storing of a turn with images (tiny LLaVA whose template strips
reasoning): the next turn's form is stored with the images' keys, so the next request
reuses all of it, and answers as a fresh engine does."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import BS, GREEDY
from fixtures_vision import VISION_CHAT_TEMPLATE, tiny_image

from pagedkv import CacheConfig, Engine

# The tiny template, with an assistant text's reasoning dropped as Qwen3's drops it.
STRIPPING = VISION_CHAT_TEMPLATE.replace(
    "{{ part['text'] }}",
    "{% if message['role'] == 'assistant' %}{{ part['text'].split('</think>')[-1] }}"
    "{% else %}{{ part['text'] }}{% endif %}",
)


@pytest.fixture(scope="module")
def stripping_llava(tiny_llava_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llava-strips") / "model"
    shutil.copytree(tiny_llava_dir, path)
    (path / "chat_template.jinja").write_text(STRIPPING)
    return path


def _user(text: str, *images: Any) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    return {"role": "user", "content": parts + [{"type": "image", "image": i} for i in images]}


def test_next_turn_with_images_is_stored_with_their_keys(stripping_llava: Path) -> None:
    first = [_user("What is this? ", tiny_image(50), tiny_image(51))]
    reply = {"role": "assistant", "content": "<think>\nlooking hard\n</think>\n\nA square."}
    second = [*first, reply, _user("And the colours?")]
    with Engine.from_pretrained(
        str(stripping_llava), config=CacheConfig(enable_prefix_caching=False)
    ) as off:
        want = off.chat(second, GREEDY).token_ids
    cfg = CacheConfig(block_size=BS, reasoning_cache="on")
    with Engine.from_pretrained(str(stripping_llava), config=cfg) as eng:
        assert eng.reasoning.active and eng.reasoning.strips
        prompt = eng.render_chat(first)
        eng.generate(prompt.token_ids, GREEDY, images=prompt.images)
        # the turn as generated: its reasoning, which the next render drops
        computed = prompt.token_ids + eng.tokenize(reply["content"])[1:]
        done = eng.store_next_turn([*first, reply], computed)
        assert done is not None and done.submitted
        assert prompt.images[1].end <= done.shared_tokens < done.num_tokens
        nxt = eng.render_chat(second)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the background prefill runs when idle
            if eng.explain(nxt.token_ids, images=nxt.images).cached_tokens > done.shared_tokens:
                break
            time.sleep(0.02)
        got = eng.generate(nxt.token_ids, GREEDY, images=nxt.images)
    assert got.cached_tokens >= done.num_tokens // BS * BS
    assert got.token_ids == want
