"""Gemma 3's images through the engine (tiny Gemma 3 VLM: sliding and global layers,
image tokens attending to each other both ways): cached == fresh over a chat with images
in RAM and on SSD after a restart, another image at the same place misses from its
block, mixed batches, and prefill chunks smaller than an image, which never end
inside one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import BS, GREEDY
from fixtures_vision import GEMMA_IMAGE_TOKENS, tiny_image
from image_helpers import cache_off, image_chat, image_prompt, user_turn

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.errors import ImagePromptError


def _turns() -> list[dict[str, Any]]:
    return [
        user_turn("Look at this picture: ", tiny_image(1)),
        user_turn("And these two, ", tiny_image(2), tiny_image(3), after=" Compare."),
        user_turn("Once more the first: ", tiny_image(1)),
    ]


@pytest.fixture(scope="module")
def fresh(tiny_gemma3_dir: Path) -> Any:
    """An engine without prefix caching: the fresh answers, shared by the tests."""
    with Engine.from_pretrained(str(tiny_gemma3_dir), config=cache_off()) as off:
        yield off


def test_chat_cached_equals_fresh_in_ram_and_on_ssd(
    tiny_gemma3_dir: Path, fresh: Engine, tmp_path: Path
) -> None:
    want = image_chat(fresh, _turns())
    ssd = tmp_path / "kv"
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=ssd, ssd_cache_bytes=64 * 2**20)
    with Engine.from_pretrained(str(tiny_gemma3_dir), config=cfg) as eng:
        got = image_chat(eng, _turns())
    assert [g.answer for g in got] == [w.answer for w in want]
    # each turn restores the earlier conversation, its images included (the tiny
    # tokenizer may merge the turn's last tokens with the answer fed back otherwise)
    for turn, before in zip(got[1:], got, strict=False):
        assert turn.cached_tokens >= before.image_end
    with Engine.from_pretrained(str(tiny_gemma3_dir), config=cfg) as eng:
        again = image_chat(eng, _turns())
        stats = eng.cache_stats()
    assert [a.answer for a in again] == [w.answer for w in want]
    assert again[0].cached_tokens >= again[0].image_end  # from SSD: RAM starts empty
    # every turn came back from SSD whole: no image's rows were needed
    assert stats.vision is not None and stats.vision.encoder_calls == 0


def test_another_image_at_the_same_place_misses_from_its_block(
    tiny_gemma3_dir: Path, fresh: Engine
) -> None:
    b = image_prompt(fresh, tiny_image(5))
    want = fresh.generate(b.token_ids, GREEDY, images=b.images).token_ids
    with Engine.from_pretrained(str(tiny_gemma3_dir), config=CacheConfig(block_size=BS)) as eng:
        a = image_prompt(eng, tiny_image(4))
        assert a.token_ids == b.token_ids  # same placeholders, other pixels
        eng.generate(a.token_ids, GREEDY, images=a.images)
        got = eng.generate(b.token_ids, GREEDY, images=b.images)
        assert got.cached_tokens == b.images[0].start // BS * BS
        assert got.token_ids == want
        same = eng.generate(a.token_ids, GREEDY, images=a.images)
        assert same.cached_tokens == len(a.token_ids) - 1


def test_a_prompt_ending_inside_a_cached_image_is_exact(
    tiny_gemma3_dir: Path, fresh: Engine
) -> None:
    """The second prompt stops at its image's last token: its restore ends inside the
    image (at most `len - 1` tokens are restored) and the last image row is computed
    seeing its image's restored keys."""
    a = image_prompt(fresh, tiny_image(6))
    (image,) = a.images
    short = a.token_ids[: image.end]
    want = fresh.generate(short, GREEDY, images=a.images).token_ids
    with Engine.from_pretrained(str(tiny_gemma3_dir), config=CacheConfig(block_size=BS)) as eng:
        eng.generate(a.token_ids, GREEDY, images=a.images)
        got = eng.generate(short, GREEDY, images=a.images)
    assert image.start < got.cached_tokens < image.end
    assert got.token_ids == want


def test_mixed_batch_equals_each_alone(fresh: Engine) -> None:
    text = [3 + (7 * i) % 400 for i in range(45)]
    image = image_prompt(fresh, tiny_image(11), tiny_image(12))
    want_text = fresh.generate(text, GREEDY).token_ids
    want_image = fresh.generate(image.token_ids, GREEDY, images=image.images).token_ids
    s1 = fresh.stream(text, GREEDY)
    s2 = fresh.stream(image.token_ids, GREEDY, images=image.images)
    assert [t for e in s1 for t in e.token_ids] == want_text
    assert [t for e in s2 for t in e.token_ids] == want_image


@pytest.mark.parametrize("deterministic", [False, True])
def test_chunks_smaller_than_an_image_keep_it_whole(
    tiny_gemma3_dir: Path, fresh: Engine, deterministic: bool
) -> None:
    """A budget of 12 tokens a step, under the 16 of an image: a chunk stops at an
    image's start and the next covers the whole image, past the budget."""
    p = image_prompt(fresh, tiny_image(13), tiny_image(14))
    want = fresh.generate(p.token_ids, GREEDY, images=p.images).token_ids
    budget = 12 + (2 if deterministic else 0)  # deterministic: prefill_chunk = 14 - 2
    chunked = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=budget, deterministic=deterministic
    )
    assert budget - (2 if deterministic else 0) < GEMMA_IMAGE_TOKENS
    with Engine.from_pretrained(
        str(tiny_gemma3_dir), config=cache_off(), scheduling=chunked
    ) as eng:
        assert eng.generate(p.token_ids, GREEDY, images=p.images).token_ids == want
        text = [3 + (7 * i) % 400 for i in range(30)]
        s1 = eng.stream(text, GREEDY)  # a text prompt beside it shares the steps
        s2 = eng.stream(p.token_ids, GREEDY, images=p.images)
        assert [t for e in s2 for t in e.token_ids] == want
        assert [t for e in s1 for t in e.token_ids] == fresh.generate(text, GREEDY).token_ids


def test_spans_of_another_attention_are_refused(fresh: Engine) -> None:
    """Spans that say their tokens attend causally (another family's) are refused."""
    ours = image_prompt(fresh, tiny_image(1))
    causal = [type(s)(s.start, s.end, s.key, s.pixels) for s in ours.images]
    with pytest.raises(ImagePromptError, match="attend causally"):
        fresh.generate(ours.token_ids, GREEDY, images=causal)


def test_preempted_image_requests_stay_exact(tiny_gemma3_dir: Path, fresh: Engine) -> None:
    """A KV budget too small for three image requests at once, in 12-token chunks: the
    preempted ones resume from the cache with their images whole and equal their
    answers alone."""
    params = SamplingParams(max_tokens=300, ignore_eos=True)  # past the first 256 reserved
    prompts = [image_prompt(fresh, tiny_image(30 + i), text=f"Picture {i}: ") for i in range(3)]
    alone = [fresh.stream(p.token_ids, params, images=p.images) for p in prompts]
    want = [[t for e in s for t in e.token_ids] for s in alone]  # batched: equal alone
    longest = max(len(p.token_ids) for p in prompts)
    budget = (2 * (longest + 256) + 40) * fresh.adapter.kv_bytes_per_token
    cfg = CacheConfig(block_size=BS, kv_budget_bytes=budget)
    small = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12)
    with Engine.from_pretrained(str(tiny_gemma3_dir), config=cfg, scheduling=small) as eng:
        streams = [eng.stream(p.token_ids, params, images=p.images) for p in prompts]
        got = [[t for e in s for t in e.token_ids] for s in streams]
        stats = eng.cache_stats().scheduling
    assert got == want
    assert stats is not None and stats.preemptions > 0, "the budget never ran short"
