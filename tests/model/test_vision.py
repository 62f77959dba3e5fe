"""The image side of a VLM (`model/vision.py`, `model/vision_cache.py`) on the tiny LLaVA:
loading, rendering into ids and spans, image keys and segments, the ragged forward with
encoder rows against transformers' own, and the encoder-row cache's LRU by bytes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_vision import IMAGE_TOKENS, tiny_image

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.errors import ImagePromptError
from pagedkv.model.batch import SeqChunk
from pagedkv.model.hf import ModelAdapter, load_model
from pagedkv.model.vision import VisionModel, image_segments, processor_fingerprint
from pagedkv.model.vision_cache import VisionCache


@pytest.fixture(scope="module")
def adapter(tiny_llava_dir: Path) -> ModelAdapter:
    return load_model(str(tiny_llava_dir), device="cpu")


def _messages(*images: Any, text: str = "Look: ") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image", "image": image} for image in images]
    parts.append({"type": "text", "text": " What is it?"})
    return [{"role": "user", "content": parts}]


def test_a_llava_directory_loads_with_its_image_side(adapter: ModelAdapter) -> None:
    assert adapter.vision is not None and adapter.batched, adapter.unbatched_reason
    config = adapter.config
    # the language model attends through the ragged batch, the vision tower as before
    assert config.get_text_config(decoder=True)._attn_implementation == "pagedkv_ragged"
    assert config.vision_config._attn_implementation != "pagedkv_ragged"
    text = adapter.apply_chat_template([{"role": "user", "content": "hi"}])
    assert adapter.render_chat([{"role": "user", "content": "hi"}]).token_ids == text


def test_render_expands_each_image_into_its_span(adapter: ModelAdapter) -> None:
    assert adapter.vision is not None
    prompt = adapter.render_chat(_messages(tiny_image(1), tiny_image(2, size=(50, 20))))
    first, second = prompt.images
    assert first.num_tokens == second.num_tokens == IMAGE_TOKENS
    assert first.end <= second.start
    token = adapter.vision.image_token_id
    placeholders = [i for i, t in enumerate(prompt.token_ids) if t == token]
    assert placeholders == [*range(first.start, first.end), *range(second.start, second.end)]
    with pytest.raises(ImagePromptError, match="placeholder"):
        adapter.render_chat(_messages(tiny_image(1), text="a literal <image> here: "))
    with pytest.raises(ImagePromptError, match="placeholder"):  # text only, too
        adapter.render_chat([{"role": "user", "content": "a literal <image> here"}])
    with pytest.raises(ImagePromptError, match="this path renders text only"):
        adapter.apply_chat_template(_messages(tiny_image(1)))


def test_image_keys_name_pixels_and_processor_settings(adapter: ModelAdapter) -> None:
    vision = adapter.vision
    assert vision is not None
    one, same, other = tiny_image(3), tiny_image(3), tiny_image(4)
    assert vision.image_key(one) == vision.image_key(same) != vision.image_key(other)
    changed = copy.deepcopy(vision.processor)
    changed.image_processor.image_mean = [0.5, 0.5, 0.5]
    assert processor_fingerprint(changed) != vision.fingerprint
    assert VisionModel(adapter.model, changed).image_key(one) != vision.image_key(one)
    # the key is the processor's settings, not its chat template
    templated = copy.deepcopy(vision.processor)
    templated.chat_template = "{{ messages }}"
    assert processor_fingerprint(templated) == vision.fingerprint
    # the same settings through another image processor class (transformers' PIL and
    # torchvision backends resize to other pixels) are another key
    other_backend = copy.deepcopy(vision.processor)
    other_backend.image_processor = copy.deepcopy(vision.processor.image_processor)
    pil = type(vision.processor.image_processor)
    torchvision_name = pil.__name__.removesuffix("Pil")  # the class the torchvision backend has
    other_backend.image_processor.__class__ = type(torchvision_name, (pil,), {})
    assert other_backend.to_dict() == vision.processor.to_dict()  # its settings say nothing
    assert processor_fingerprint(other_backend) != vision.fingerprint


def test_segments_change_block_keys_from_the_image_block_on(adapter: ModelAdapter) -> None:
    a = adapter.render_chat(_messages(tiny_image(5), tiny_image(6)))
    b = adapter.render_chat(_messages(tiny_image(5), tiny_image(7)))
    assert a.token_ids == b.token_ids
    hasher = BlockHasher(block_size=8, seed=b"s")
    keys_a = hasher.hash_blocks(a.token_ids, ExtraKeys(segments=image_segments(a.images)))
    keys_b = hasher.hash_blocks(b.token_ids, ExtraKeys(segments=image_segments(b.images)))
    where = b.images[1].start // 8  # the second image's first block
    assert keys_a[:where] == keys_b[:where]
    assert all(x != y for x, y in zip(keys_a[where:], keys_b[where:], strict=True))
    # each segment folds in the ones before it (two images may start in one block)
    (_, k1), (_, k2) = image_segments(a.images)
    ((_, k2_alone),) = image_segments(a.images[1:])
    assert k2 != k2_alone and k1 != k2


def test_ragged_forward_with_images_matches_transformers(adapter: ModelAdapter) -> None:
    prompt = adapter.render_chat(_messages(tiny_image(8)))
    ids = prompt.token_ids
    with torch.inference_mode():
        want = adapter.model(
            input_ids=torch.tensor([ids]), pixel_values=prompt.images[0].pixels
        ).logits[0, -1]
    kv = adapter.new_kv_buffer(len(ids))
    got = adapter.forward_batch([SeqChunk(kv, 0, ids, True, images=prompt.images)])[0]
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    # without the encoder rows the placeholders' own embeddings give other logits
    plain = adapter.forward_batch([SeqChunk(adapter.new_kv_buffer(len(ids)), 0, ids, True)])[0]
    assert not torch.allclose(plain, want, atol=1e-2)


def test_chunks_cut_inside_an_image_and_mixed_batches_are_exact(adapter: ModelAdapter) -> None:
    prompt = adapter.render_chat(_messages(tiny_image(9)))
    ids, images = prompt.token_ids, prompt.images
    whole = adapter.forward_batch(
        [SeqChunk(adapter.new_kv_buffer(len(ids)), 0, ids, True, images=images)]
    )[0]
    cut = images[0].start + 5
    kv = adapter.new_kv_buffer(len(ids))
    adapter.forward_batch([SeqChunk(kv, 0, ids[:cut], False, images=images)])
    rest = adapter.forward_batch([SeqChunk(kv, cut, ids[cut:], True, True, images=images)])[0]
    assert torch.equal(rest, whole)
    text = [3 + (5 * i) % 400 for i in range(30)]
    alone = adapter.forward_batch([SeqChunk(adapter.new_kv_buffer(30), 0, text, True)])[0]
    both = adapter.forward_batch(
        [
            SeqChunk(adapter.new_kv_buffer(30), 0, text, True),
            SeqChunk(adapter.new_kv_buffer(len(ids)), 0, ids, True, images=images),
        ]
    )
    assert torch.equal(both[0], alone) and torch.equal(both[1], whole)


def test_vision_cache_is_lru_by_bytes() -> None:
    cache = VisionCache(capacity_bytes=2 * 64)  # room for two 16-float tensors
    rows = {k: torch.full((16,), float(i)) for i, k in enumerate((b"a", b"b", b"c"))}
    cache.put(b"a", rows[b"a"])
    cache.put(b"b", rows[b"b"])
    assert cache.get(b"a") is rows[b"a"]  # a is now the most recent
    cache.put(b"c", rows[b"c"])
    assert cache.get(b"b") is None and cache.get(b"a") is not None and len(cache) == 2
    assert cache.bytes == 128
    cache.put(b"big", torch.zeros(64))  # larger than the whole budget: not kept
    assert cache.get(b"big") is None and cache.bytes == 128
    cache.resize(64)
    assert len(cache) == 1 and cache.bytes == 64
    stats = cache.stats()
    assert (stats.hits, stats.misses) == (2, 2)
    with pytest.raises(ValueError, match=">= 0"):
        VisionCache(-1)
