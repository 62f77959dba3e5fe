"""Images in the prompt through the engine (tiny LLaVA): cached == fresh over a chat with
images, image keys in the hash chain (another image or a moved one misses from its
block on), mixed batches, chunks that start inside an image, the encoder-row cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import BS, GREEDY, run_worker
from fixtures_vision import IMAGE_TOKENS, tiny_image
from image_helpers import cache_off, image_chat, image_prompt, user_turn

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.errors import ImagePromptError


def _ram(**kw: Any) -> CacheConfig:
    return CacheConfig(block_size=BS, **kw)


def _turns() -> list[dict[str, Any]]:
    return [
        user_turn("Look at this picture: ", tiny_image(1)),
        user_turn("And these two, ", tiny_image(2), tiny_image(3), after=" Compare."),
        user_turn("Once more the first: ", tiny_image(1)),
    ]


def test_chat_with_images_cached_equals_fresh(tiny_llava_dir: Path, tmp_path: Path) -> None:
    with Engine.from_pretrained(str(tiny_llava_dir), config=cache_off()) as off:
        want = image_chat(off, _turns())
    with Engine.from_pretrained(str(tiny_llava_dir), config=_ram()) as eng:
        got = image_chat(eng, _turns())
        stats = eng.cache_stats().vision
    assert [g.answer for g in got] == [w.answer for w in want]
    # every later turn restores the whole earlier conversation, its images included
    for turn, before in zip(got[1:], got, strict=False):
        assert turn.cached_tokens >= before.num_prompt
    # images 1, 2, 3 ran the encoder; image 1 again at turn 3 read its rows from the cache
    assert stats is not None and (stats.encoder_calls, stats.hits) == (3, 1)
    # after a restart the restored images' rows are never needed: turn 3's image alone runs
    ssd = tmp_path / "kv"
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=ssd, ssd_cache_bytes=64 * 2**20)
    with Engine.from_pretrained(str(tiny_llava_dir), config=cfg) as eng:
        first = image_chat(eng, _turns()[:2])
    with Engine.from_pretrained(str(tiny_llava_dir), config=cfg) as eng:
        again = image_chat(eng, _turns())
        calls = eng.cache_stats().vision
    assert [a.answer for a in again] == [w.answer for w in want]
    assert again[1].cached_tokens == first[1].num_prompt - 1  # turn 2's prompt from SSD whole
    assert calls is not None and calls.encoder_calls == 1  # turn 3's image only


def test_another_image_at_the_same_place_misses_from_its_block(tiny_llava_dir: Path) -> None:
    with Engine.from_pretrained(str(tiny_llava_dir), config=cache_off()) as off:
        b = image_prompt(off, tiny_image(5))
        want = off.generate(b.token_ids, GREEDY, images=b.images).token_ids
    with Engine.from_pretrained(str(tiny_llava_dir), config=_ram()) as eng:
        a = image_prompt(eng, tiny_image(4))
        b = image_prompt(eng, tiny_image(5))
        assert a.token_ids == b.token_ids  # same placeholders, other pixels
        eng.generate(a.token_ids, GREEDY, images=a.images)
        got = eng.generate(b.token_ids, GREEDY, images=b.images)
        start = b.images[0].start
        assert got.cached_tokens == start // BS * BS
        assert got.token_ids == want
        # the same image again reuses the whole prompt
        assert eng.generate(a.token_ids, GREEDY, images=a.images).cached_tokens == (
            len(a.token_ids) - 1
        )


def test_the_same_images_swapped_miss_where_they_moved(tiny_llava_dir: Path) -> None:
    x, y = tiny_image(6), tiny_image(7)
    with Engine.from_pretrained(str(tiny_llava_dir), config=cache_off()) as off:
        b = image_prompt(off, y, x)
        want = off.generate(b.token_ids, GREEDY, images=b.images).token_ids
    with Engine.from_pretrained(str(tiny_llava_dir), config=_ram()) as eng:
        a, b = image_prompt(eng, x, y), image_prompt(eng, y, x)
        assert a.token_ids == b.token_ids
        eng.generate(a.token_ids, GREEDY, images=a.images)
        got = eng.generate(b.token_ids, GREEDY, images=b.images)
        assert got.cached_tokens == b.images[0].start // BS * BS
        assert got.token_ids == want


def test_two_images_starting_in_one_block_both_key_it(tiny_llava_dir: Path) -> None:
    """A block takes the last segment starting in it; the first image must count too."""
    x, y, z = tiny_image(8), tiny_image(9), tiny_image(10)
    cfg = CacheConfig(block_size=32)
    with Engine.from_pretrained(str(tiny_llava_dir), config=cfg) as eng:
        a, b = image_prompt(eng, x, y, text="A:"), image_prompt(eng, z, y, text="A:")
        assert a.images[1].start < 32 < len(a.token_ids)  # both start in block 0
        eng.generate(a.token_ids, GREEDY, images=a.images)
        assert eng.generate(b.token_ids, GREEDY, images=b.images).cached_tokens == 0


def test_mixed_batch_equals_each_alone(tiny_llava_dir: Path) -> None:
    text = [3 + (7 * i) % 400 for i in range(45)]
    with Engine.from_pretrained(str(tiny_llava_dir), config=cache_off()) as off:
        image = image_prompt(off, tiny_image(11), tiny_image(12))
        want_text = off.generate(text, GREEDY).token_ids
        want_image = off.generate(image.token_ids, GREEDY, images=image.images).token_ids
        steps = off.cache_stats().scheduling
        assert steps is not None
        before = steps.steps
        s1 = off.stream(text, GREEDY)
        s2 = off.stream(image.token_ids, GREEDY, images=image.images)
        got_text = [t for e in s1 for t in e.token_ids]
        got_image = [t for e in s2 for t in e.token_ids]
        after = off.cache_stats().scheduling
    assert got_text == want_text and got_image == want_image
    assert after is not None and after.steps - before < 2 * GREEDY.max_tokens  # shared steps


def test_chunks_starting_inside_an_image_equal_the_whole_prompt(tiny_llava_dir: Path) -> None:
    """Prefill chunks of 12 tokens cut each 16-token image; with no encoder-row cache
    every chunk runs the encoder and slices its rows."""
    chunked = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=12)
    with Engine.from_pretrained(str(tiny_llava_dir), config=cache_off()) as off:
        p = image_prompt(off, tiny_image(13), tiny_image(14))
        want = off.generate(p.token_ids, GREEDY, images=p.images).token_ids
    for cache_bytes, calls in ((0, None), (2**20, 2)):
        cfg = cache_off(vision_cache_bytes=cache_bytes)
        with Engine.from_pretrained(str(tiny_llava_dir), config=cfg, scheduling=chunked) as eng:
            assert eng.generate(p.token_ids, GREEDY, images=p.images).token_ids == want
            stats = eng.cache_stats().vision
        assert stats is not None
        if calls is None:
            assert stats.encoder_calls > 2  # an image cut by chunks ran the encoder twice
        else:
            assert stats.encoder_calls == calls


def test_vision_cache_hit_skips_the_encoder(tiny_llava_dir: Path) -> None:
    with Engine.from_pretrained(str(tiny_llava_dir), config=cache_off()) as eng:
        first = image_prompt(eng, tiny_image(15))
        second = image_prompt(eng, tiny_image(15), text="Again, the same picture: ")
        eng.generate(first.token_ids, GREEDY, images=first.images)
        eng.generate(second.token_ids, GREEDY, images=second.images)
        stats = eng.cache_stats().vision
    assert stats is not None
    assert stats.encoder_calls == 1 and stats.hits >= 1 and stats.entries == 1
    assert stats.bytes == IMAGE_TOKENS * 64 * 4  # 16 rows of the 64-wide float32 model


def test_text_model_refuses_images(tiny_llama_dir: Path) -> None:
    with Engine.from_pretrained(str(tiny_llama_dir), config=cache_off()) as eng:
        assert not eng.takes_images
        with pytest.raises(ImagePromptError, match="takes no images"):
            eng.render_chat([user_turn("Look: ", tiny_image(1))])
        plain = eng.render_chat([{"role": "user", "content": "hi"}])
        assert plain.token_ids == eng.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("family", ["tiny_llava_dir", "tiny_gemma3_dir", "tiny_qwen2_vl_dir"])
def test_a_second_process_reuses_image_blocks_from_redis(
    family: str, request: pytest.FixtureRequest, redis_url: str
) -> None:
    """Each family: a chat about an image, computed here, reaches Redis; a second process
    (its RAM empty, rendering the chat itself) answers it from there as fresh, and
    another image at the same place misses there from the image's block on."""
    model = request.getfixturevalue(family)
    params = SamplingParams(max_tokens=8, ignore_eos=True)  # as engine_worker.py's

    def chat(seed: int) -> list[dict[str, Any]]:
        parts = [{"type": "text", "text": "Here: "}, {"type": "image", "image": tiny_image(seed)}]
        return [{"role": "user", "content": parts}]

    with Engine.from_pretrained(str(model), config=cache_off()) as off:
        a, b = off.render_chat(chat(16)), off.render_chat(chat(17))
        want = [off.generate(p.token_ids, params, images=p.images).token_ids for p in (a, b)]
    cache = {"block_size": BS, "redis_url": redis_url}
    with Engine.from_pretrained(str(model), config=CacheConfig(**cache)) as eng:
        eng.generate(a.token_ids, params, images=a.images)
    chats = [{"text": "Here: ", "seeds": [16]}, {"text": "Here: ", "seeds": [17]}]
    again, other, _ = run_worker(model, cache, [], image_chats=chats)
    assert [again["token_ids"], other["token_ids"]] == want
    assert again["image_starts"] == [a.images[0].start]  # the same rendering there
    assert again["tier_hits"].get("redis", 0) == again["cached_tokens"]
    assert again["cached_tokens"] >= (len(a.token_ids) - 1) // BS * BS
    assert other["cached_tokens"] == b.images[0].start // BS * BS


def test_preempted_image_requests_and_n_samples_stay_exact(tiny_llava_dir: Path) -> None:
    """A KV budget too small for four image requests at once: the preempted ones resume
    from the cache with their images' keys and equal their answers alone; n=2 samples
    of an image prompt fork its KV and decode as one alone does."""
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    with Engine.from_pretrained(str(tiny_llava_dir), config=cache_off()) as off:
        prompts = [image_prompt(off, tiny_image(30 + i), text=f"Picture {i}: ") for i in range(4)]
        want = [off.generate(p.token_ids, params, images=p.images).token_ids for p in prompts]
        per_token = off.adapter.kv_bytes_per_token
    # two requests start (prompt + 256 tokens each) but cannot both grow to their 300
    longest = max(len(p.token_ids) for p in prompts)
    cfg = CacheConfig(block_size=BS, kv_budget_bytes=(2 * (longest + 256) + 40) * per_token)
    with Engine.from_pretrained(str(tiny_llava_dir), config=cfg) as eng:
        streams = [eng.stream(p.token_ids, params, images=p.images) for p in prompts]
        got = [[t for e in s for t in e.token_ids] for s in streams]
        stats = eng.cache_stats().scheduling
        pair = eng.generate_n(
            prompts[0].token_ids,
            SamplingParams(max_tokens=8, ignore_eos=True, n=2),
            images=prompts[0].images,
        )
    assert got == want
    assert stats is not None and stats.preemptions > 0, "the budget never ran short"
    assert [r.token_ids for r in pair] == [want[0][:8]] * 2
