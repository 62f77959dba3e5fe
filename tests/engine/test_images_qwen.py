"""Images on Qwen2-VL through the engine: M-RoPE positions kept with the request, so
cached == fresh over a chat with images (RAM, then SSD after a restart), another image
or another grid at the same place misses from its block on, mixed batches, prefill
chunks cut inside an image, preempted and resumed requests and n=2 samples decode at
the prompt's offset."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import BS, GREEDY
from fixtures_vision import tiny_image
from image_helpers import image_chat, image_prompt, user_turn

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine.scheduler import SchedulerConfig
from pagedkv.errors import ImagePromptError

WIDE = (50, 20)  # 12 tokens in a 2x6 grid, where the default 40x36 takes a 3x4 one


@pytest.fixture(scope="module")
def off(tiny_qwen2_vl_dir: Path) -> Any:
    """An engine without prefix caching: every answer computed fresh."""
    with Engine.from_pretrained(
        str(tiny_qwen2_vl_dir), config=CacheConfig(enable_prefix_caching=False)
    ) as eng:
        yield eng


def _turns() -> list[dict[str, Any]]:
    return [
        user_turn("Look at this picture: ", tiny_image(1)),
        user_turn("And these two, ", tiny_image(2, size=WIDE), tiny_image(3), after=" Compare."),
        user_turn("Once more the first: ", tiny_image(1)),
    ]


def test_chat_with_images_cached_equals_fresh(
    off: Engine, tiny_qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    want = image_chat(off, _turns())
    with Engine.from_pretrained(str(tiny_qwen2_vl_dir), config=CacheConfig(block_size=BS)) as eng:
        got = image_chat(eng, _turns())
    assert [g.answer for g in got] == [w.answer for w in want]
    for turn, before in zip(got[1:], got, strict=False):
        assert turn.cached_tokens >= before.num_prompt  # each turn restores all before it
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=tmp_path / "kv", ssd_cache_bytes=64 * 2**20)
    with Engine.from_pretrained(str(tiny_qwen2_vl_dir), config=cfg) as eng:
        first = image_chat(eng, _turns()[:2])
    with Engine.from_pretrained(str(tiny_qwen2_vl_dir), config=cfg) as eng:
        again = image_chat(eng, _turns())
    assert [a.answer for a in again] == [w.answer for w in want]
    assert again[1].cached_tokens == first[1].num_prompt - 1  # turn 2's prompt from SSD whole


def test_another_image_or_grid_at_the_same_place_misses_from_its_block(
    off: Engine, tiny_qwen2_vl_dir: Path
) -> None:
    """Same placeholder count: other pixels, or other pixels in another grid (which
    moves every later position), both miss from the image's block on; swapped images
    miss where they moved."""
    x, y, wide = tiny_image(4), tiny_image(5), tiny_image(6, size=WIDE)
    u, v = tiny_image(12), tiny_image(13, size=WIDE)  # apart: no earlier prompt holds them
    prompts = {
        "x": image_prompt(off, x), "y": image_prompt(off, y), "wide": image_prompt(off, wide),
        "u,v": image_prompt(off, u, v), "v,u": image_prompt(off, v, u),
    }  # fmt: skip
    want = {k: off.generate(p.token_ids, GREEDY, images=p.images).token_ids
            for k, p in prompts.items()}  # fmt: skip
    assert prompts["x"].token_ids == prompts["y"].token_ids == prompts["wide"].token_ids
    with Engine.from_pretrained(str(tiny_qwen2_vl_dir), config=CacheConfig(block_size=BS)) as eng:
        for first, then in (("x", "y"), ("x", "wide"), ("u,v", "v,u")):
            a, b = prompts[first], prompts[then]
            eng.generate(a.token_ids, GREEDY, images=a.images)
            got = eng.generate(b.token_ids, GREEDY, images=b.images)
            assert got.cached_tokens == b.images[0].start // BS * BS, (first, then)
            assert got.token_ids == want[then]
            again = eng.generate(a.token_ids, GREEDY, images=a.images)
            assert again.cached_tokens == len(a.token_ids) - 1
            assert again.token_ids == want[first]


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_greedy_answer_equals_transformers_decode(
    family: str, off: Engine, request: pytest.FixtureRequest
) -> None:
    """The engine's decode steps sit at index + the prompt's offset: its greedy answer
    is transformers' own (its forward with pixels and grids, then its cache)."""
    if family == "qwen2_5_vl":
        directory = request.getfixturevalue("tiny_qwen2_5_vl_dir")
        cfg = CacheConfig(enable_prefix_caching=False)
        with Engine.from_pretrained(str(directory), config=cfg) as eng:
            _check_greedy_against_transformers(eng)
        return
    _check_greedy_against_transformers(off)


def _check_greedy_against_transformers(off: Engine) -> None:

    p = image_prompt(off, tiny_image(14), tiny_image(15, size=WIDE))
    model = off.adapter.model
    ids = torch.tensor([p.token_ids])
    inputs = {
        "pixel_values": torch.cat([span.pixels for span in p.images]),
        "image_grid_thw": torch.tensor([span.grid_thw for span in p.images]),
        "mm_token_type_ids": (ids == off.adapter.vision.image_token_id).int(),
    }
    want: list[int] = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **inputs)
        while len(want) < GREEDY.max_tokens:
            want.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([want[-1:]]), cache=out.cache)
    assert off.generate(p.token_ids, GREEDY, images=p.images).token_ids == want


def test_mixed_batch_equals_each_alone(off: Engine) -> None:
    text = [3 + (7 * i) % 400 for i in range(45)]
    one = image_prompt(off, tiny_image(7), tiny_image(8, size=WIDE))
    two = image_prompt(off, tiny_image(9, size=WIDE), text="Another: ")
    want = [
        off.generate(text, GREEDY).token_ids,
        off.generate(one.token_ids, GREEDY, images=one.images).token_ids,
        off.generate(two.token_ids, GREEDY, images=two.images).token_ids,
    ]
    streams = [
        off.stream(text, GREEDY),
        off.stream(one.token_ids, GREEDY, images=one.images),
        off.stream(two.token_ids, GREEDY, images=two.images),
    ]
    assert [[t for e in s for t in e.token_ids] for s in streams] == want


def test_chunks_cut_inside_an_image_equal_the_whole_prompt(
    off: Engine, tiny_qwen2_vl_dir: Path
) -> None:
    p = image_prompt(off, tiny_image(10), tiny_image(11, size=WIDE))
    want = off.generate(p.token_ids, GREEDY, images=p.images).token_ids
    chunked = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=5)  # cuts every image
    cfg = CacheConfig(enable_prefix_caching=False)
    with Engine.from_pretrained(str(tiny_qwen2_vl_dir), config=cfg, scheduling=chunked) as eng:
        assert eng.generate(p.token_ids, GREEDY, images=p.images).token_ids == want


def test_preempted_and_forked_image_requests_decode_at_their_offset(
    off: Engine, tiny_qwen2_vl_dir: Path
) -> None:
    """A KV budget too small for two image requests at once: the preempted ones
    resume from the cache and equal their answers alone; n=2 samples fork the prompt's
    KV and decode as one alone does."""
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    prompts = [
        image_prompt(off, tiny_image(30 + i, size=WIDE if i % 2 else (40, 36)), text=f"Pic {i}: ")
        for i in range(2)
    ]
    want = [off.generate(p.token_ids, params, images=p.images).token_ids for p in prompts]
    per_token = off.adapter.kv_bytes_per_token
    longest = max(len(p.token_ids) for p in prompts)
    cfg = CacheConfig(block_size=BS, kv_budget_bytes=(2 * (longest + 256) + 40) * per_token)
    with Engine.from_pretrained(str(tiny_qwen2_vl_dir), config=cfg) as eng:
        streams = [eng.stream(p.token_ids, params, images=p.images) for p in prompts]
        got = [[t for e in s for t in e.token_ids] for s in streams]
        stats = eng.cache_stats().scheduling
        pair = eng.generate_n(
            prompts[1].token_ids,
            SamplingParams(max_tokens=8, ignore_eos=True, n=2),
            images=prompts[1].images,
        )
    assert got == want
    assert stats is not None and stats.preemptions > 0, "the budget never ran short"
    assert [r.token_ids for r in pair] == [want[1][:8]] * 2


def test_spans_without_their_grid_are_refused(off: Engine) -> None:
    """A span whose position grid is missing or does not cover its tokens would place
    the prompt at other positions than the model's: refused before it is queued."""
    p = image_prompt(off, tiny_image(16))
    (span,) = p.images
    for grid in (None, (1, 2, 2)):
        bad = (dataclasses.replace(span, rope_grid=grid),)
        with pytest.raises(ImagePromptError, match="position grid"):
            off.generate(p.token_ids, GREEDY, images=bad)
