"""Qwen2-VL's and Qwen2.5-VL's images (`model/mrope.py`, `model/vision_qwen.py`) on tiny
random models of each: M-RoPE positions against the model's own `get_rope_index`, the
ragged forward and its decode steps against transformers' own forward and cache, chunks
cut inside an image, mixed batches, and text-only prompts on plain positions."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_vision import tiny_image

from pagedkv.model.batch import SeqChunk, plan_batch
from pagedkv.model.hf import ModelAdapter, load_model
from pagedkv.model.mrope import mrope_positions
from pagedkv.model.vision import ImagePrompt, processor_fingerprint


@pytest.fixture(scope="module", params=["tiny_qwen2_vl_dir", "tiny_qwen2_5_vl_dir"])
def adapter(request: pytest.FixtureRequest) -> ModelAdapter:
    """Each family: Qwen2-VL, and Qwen2.5-VL (window attention in its vision tower)."""
    directory: Path = request.getfixturevalue(request.param)
    return load_model(str(directory), device="cpu")


def _prompt(adapter: ModelAdapter, *images: Any, text: str = "Look: ") -> ImagePrompt:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for image in images:
        parts += [{"type": "image", "image": image}, {"type": "text", "text": " and "}]
    parts.append({"type": "text", "text": "what is it?"})
    return adapter.render_chat([{"role": "user", "content": parts}])


def _theirs(adapter: ModelAdapter, prompt: ImagePrompt) -> dict[str, torch.Tensor]:
    """transformers' inputs for the prompt: ids, all patches, grids, token types."""
    ids = torch.tensor([prompt.token_ids])
    grids = [span.grid_thw for span in prompt.images]
    assert adapter.vision is not None and all(g is not None for g in grids)
    return {
        "input_ids": ids,
        "pixel_values": torch.cat([span.pixels for span in prompt.images]),
        "image_grid_thw": torch.tensor(grids),
        "mm_token_type_ids": (ids == adapter.vision.image_token_id).int(),
    }


def test_positions_follow_each_image_grid(adapter: ModelAdapter) -> None:
    # 40x36 and 50x20 pixels: 12 tokens each, in a 3x4 and a 2x6 grid
    prompt = _prompt(adapter, tiny_image(1), tiny_image(2, size=(50, 20)))
    first, second = prompt.images
    assert (first.rope_grid, second.rope_grid) == ((1, 3, 4), (1, 2, 6))
    positions = mrope_positions(prompt.images)
    assert positions is not None
    theirs = _theirs(adapter, prompt)
    want, delta = adapter.model.model.get_rope_index(
        theirs["input_ids"], theirs["mm_token_type_ids"], theirs["image_grid_thw"]
    )
    n = len(prompt.token_ids)
    assert torch.equal(positions.rows(0, n), want[:, 0])
    assert positions.delta == int(delta) == (4 - 12) + (6 - 12)
    for start in (0, first.start + 5, second.start + 1, second.end):  # any cut, same rows
        assert torch.equal(
            positions.rows(start, 7), positions.rows(0, n + 10)[:, start : start + 7]
        )
    # a decode step's three rows are its index plus the prompt's delta
    assert positions.rows(n + 3, 1).tolist() == [[n + 3 + positions.delta]] * 3
    # a text-only prompt has no M-RoPE table: plain [1, rows] positions, as before
    assert mrope_positions(_prompt(adapter).images) is None
    chunk = SeqChunk(adapter.new_kv_buffer(8), 0, [5, 6, 7], True)
    assert plan_batch([chunk])[2].tolist() == [[0, 1, 2]]


def test_prefill_and_decode_match_transformers(adapter: ModelAdapter) -> None:
    prompt = _prompt(adapter, tiny_image(3), tiny_image(4, size=(50, 20)))
    ids, images = prompt.token_ids, prompt.images
    positions = mrope_positions(images)
    with torch.inference_mode():
        out = adapter.model(**_theirs(adapter, prompt), use_cache=True)
        want = [out.logits[0, -1]]
        cache = out.cache
        steps = [int(want[0].argmax())]
        for _ in range(3):  # transformers' decode: its cache and its rope_deltas
            out = adapter.model(input_ids=torch.tensor([[steps[-1]]]), cache=cache)
            cache = out.cache
            want.append(out.logits[0, -1])
            steps.append(int(want[-1].argmax()))
    kv = adapter.new_kv_buffer(len(ids) + 8)
    got = [adapter.forward_batch([SeqChunk(kv, 0, ids, True, True, None, images, positions)])[0]]
    for i, token in enumerate(steps[:-1]):
        start = len(ids) + i
        got.append(
            adapter.forward_batch([SeqChunk(kv, start, [token], True, positions=positions)])[0]
        )
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-4), float((g - w).abs().max())
    # without the offset the decode step is another position: other logits
    plain = adapter.forward_batch([SeqChunk(kv, len(ids), steps[:1], True)])[0]
    assert not torch.allclose(plain, want[1], atol=1e-3)


def test_chunks_cut_inside_an_image_and_mixed_batches_are_exact(adapter: ModelAdapter) -> None:
    a = _prompt(adapter, tiny_image(5), tiny_image(6, size=(50, 20)))
    b = _prompt(adapter, tiny_image(7, size=(50, 20)), text="Another one: ")
    pa, pb = mrope_positions(a.images), mrope_positions(b.images)

    def whole(p: ImagePrompt, pos: Any) -> SeqChunk:
        return SeqChunk(adapter.new_kv_buffer(len(p.token_ids)), 0, p.token_ids, True,
                        True, None, p.images, pos)  # fmt: skip

    want_a = adapter.forward_batch([whole(a, pa)])[0]
    want_b = adapter.forward_batch([whole(b, pb)])[0]
    for cut in (a.images[0].start + 5, a.images[1].start + 1):
        kv = adapter.new_kv_buffer(len(a.token_ids))
        head = SeqChunk(kv, 0, a.token_ids[:cut], False, True, None, a.images, pa)
        adapter.forward_batch([head])
        tail = SeqChunk(kv, cut, a.token_ids[cut:], True, True, None, a.images, pa)
        assert torch.equal(adapter.forward_batch([tail])[0], want_a)
    text = [3 + (5 * i) % 400 for i in range(30)]
    alone = adapter.forward_batch([SeqChunk(adapter.new_kv_buffer(30), 0, text, True)])[0]
    mixed = adapter.forward_batch(
        [whole(a, pa), SeqChunk(adapter.new_kv_buffer(30), 0, text, True), whole(b, pb)]
    )
    assert torch.equal(mixed[0], want_a) and torch.equal(mixed[1], alone)
    assert torch.equal(mixed[2], want_b)


def test_text_only_prompts_take_plain_positions(adapter: ModelAdapter) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    ids = adapter.apply_chat_template(messages)
    assert adapter.render_chat(messages).token_ids == ids
    want, _ = adapter.forward(ids)  # transformers' own positions for text
    got = adapter.forward_batch([SeqChunk(adapter.new_kv_buffer(len(ids)), 0, ids, True)])[0]
    assert torch.allclose(got, want, atol=1e-4)


def test_same_token_count_other_grid_other_key(adapter: ModelAdapter) -> None:
    """Two images of 12 tokens each, in other grids: the same ids, other keys."""
    a = _prompt(adapter, tiny_image(8))
    b = _prompt(adapter, tiny_image(8, size=(50, 20)))
    assert a.token_ids == b.token_ids
    assert a.images[0].rope_grid != b.images[0].rope_grid
    assert a.images[0].key != b.images[0].key
    # the key names the processor's settings (its pixel bounds shape the grid), not
    # its chat template
    vision = adapter.vision
    assert vision is not None
    bounds = copy.deepcopy(vision.processor)
    bounds.image_processor.size = {"shortest_edge": 8 * 8, "longest_edge": 64 * 64}
    assert processor_fingerprint(bounds) != vision.fingerprint
    templated = copy.deepcopy(vision.processor)
    templated.chat_template = "{{ messages }}"
    assert processor_fingerprint(templated) == vision.fingerprint
