"""Explain over prompts with images (tiny LLaVA): the request's image keys are looked up
as the request's own, so `cached_tokens` is what the request then reuses; another image
at the same place is `image_changed` naming that image, and only then (other text, or
the same image under another salt, is not)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import BS, GREEDY
from fixtures_vision import tiny_image
from image_helpers import user_turn

from pagedkv import CacheConfig, Engine
from pagedkv.cache.explain import REASONS


@pytest.fixture(scope="module")
def eng(tiny_llava_dir: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(str(tiny_llava_dir), config=CacheConfig(block_size=BS)) as e:
        yield e


def _check(eng: Engine, messages: list[dict[str, Any]], salt: str | None = None) -> Any:
    """Explain, then send: the explained reuse is the request's."""
    prompt = eng.render_chat(messages)
    exp = eng.explain(prompt.token_ids, images=prompt.images, cache_salt=salt)
    got = eng.generate(prompt.token_ids, GREEDY, images=prompt.images, cache_salt=salt)
    assert exp.cached_tokens == got.cached_tokens, exp
    if exp.miss is not None:
        assert exp.miss.reason in REASONS and exp.miss.token_index == exp.cached_tokens
    return prompt, exp


def test_explain_with_images_matches_the_request_and_names_the_changed_image(
    eng: Engine,
) -> None:
    x, y, z = tiny_image(40), tiny_image(41), tiny_image(42)
    first, exp = _check(eng, [user_turn("Two pictures: ", x, y)])
    assert exp.miss is not None and exp.miss.reason == "new"
    _, again = _check(eng, [user_turn("Two pictures: ", x, y)])
    assert again.cached_tokens == len(first.token_ids) - 1 and again.miss is None
    # the first image swapped: image 0 broke the prefix at its block
    _, swap0 = _check(eng, [user_turn("Two pictures: ", z, y)])
    assert swap0.miss is not None and swap0.miss.reason == "image_changed"
    assert swap0.cached_tokens == first.images[0].start // BS * BS
    assert "image 0 " in swap0.miss.detail
    # the second image swapped: image 1, later in the prompt
    _, swap1 = _check(eng, [user_turn("Two pictures: ", x, z)])
    assert swap1.miss is not None and swap1.miss.reason == "image_changed"
    assert "image 1 " in swap1.miss.detail
    assert swap1.cached_tokens == first.images[1].start // BS * BS


def test_other_text_or_another_salt_is_not_image_changed(eng: Engine) -> None:
    x, y = tiny_image(43), tiny_image(44)
    _check(eng, [user_turn("Look: ", x)])
    # other words before the image: the tokens differ, not the image
    _, text = _check(eng, [user_turn("Look here, friend: ", y)])
    assert text.miss is not None and text.miss.reason != "image_changed"
    # another image under another salt: that salt never saw the first
    _, salted = _check(eng, [user_turn("Look: ", y)], salt="tenant-b")
    assert salted.miss is not None and salted.miss.reason == "new"
    # and a text-only prompt with no image at the miss is never image_changed
    _, plain = _check(eng, [{"role": "user", "content": "No picture at all, just words."}])
    assert plain.miss is not None and plain.miss.reason in ("new", "diverged")
