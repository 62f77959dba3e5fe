"""Gemma 3's images (tiny random Gemma 3 VLM: SigLIP tower, sliding and global layers):
the ragged forward with its image rows attending to each other both ways equals
transformers' own forward (token_type_ids), chunks that keep images whole, a restored
prefix that ends inside an image, and the chunk planning that keeps images whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fixtures_vision import GEMMA_IMAGE_TOKENS, GEMMA_WINDOW, tiny_image

from pagedkv.model.batch import SeqChunk
from pagedkv.model.hf import ModelAdapter, load_model
from pagedkv.model.vision import ImageSpan, template_messages, whole_image_take


@pytest.fixture(scope="module")
def adapter(tiny_gemma3_dir: Path) -> ModelAdapter:
    return load_model(str(tiny_gemma3_dir), device="cpu")


@pytest.fixture(scope="module")
def reference(tiny_gemma3_dir: Path) -> Any:
    """transformers' own Gemma 3, with its own attention and masks."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        tiny_gemma3_dir, dtype=torch.float32, local_files_only=True
    )


def _messages(*images: Any, text: str = "Look: ") -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image", "image": image} for image in images]
    parts.append({"type": "text", "text": " What is it?"})
    return [{"role": "user", "content": parts}]


def _fresh(adapter: ModelAdapter, ids: list[int], images: Any) -> torch.Tensor:
    return adapter.forward_batch(
        [SeqChunk(adapter.new_kv_buffer(len(ids)), 0, ids, True, images=images)]
    )[0]


def test_a_gemma3_directory_loads_with_both_layer_kinds(adapter: ModelAdapter) -> None:
    assert adapter.vision is not None and adapter.batched, adapter.unbatched_reason
    assert adapter.vision.bidirectional
    assert adapter.kinds.describe() == f"sliding({GEMMA_WINDOW}) x3, full x1"
    prompt = adapter.render_chat(_messages(tiny_image(1), tiny_image(2)))
    tok = adapter.vision.processor.tokenizer
    for span in prompt.images:
        assert span.num_tokens == GEMMA_IMAGE_TOKENS and span.bidirectional
        # the processor's begin/end-of-image tokens sit outside the span
        assert prompt.token_ids[span.start - 1] == tok.boi_token_id
        assert prompt.token_ids[span.end] == tok.eoi_token_id
    assert len(prompt.token_ids) > 3 * GEMMA_WINDOW  # the sliding layers drop keys


def test_ragged_forward_equals_transformers_bidirectional_forward(
    adapter: ModelAdapter, reference: Any
) -> None:
    messages = _messages(tiny_image(3), tiny_image(4))
    prompt = adapter.render_chat(messages)
    converted, images = template_messages(messages)
    processor = adapter.vision.processor  # type: ignore[union-attr]
    text = processor.apply_chat_template(converted, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=text, images=[i.pixels for i in images], add_special_tokens=False,
        return_tensors="pt",
    )  # fmt: skip
    assert inputs["input_ids"][0].tolist() == prompt.token_ids
    with torch.inference_mode():
        want = reference(**inputs).logits[0, -1]  # token_type_ids: images both ways
        causal = reference(
            input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]
        ).logits[0, -1]
    got = _fresh(adapter, prompt.token_ids, prompt.images)
    assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    # the mask matters: with image tokens attending causally the logits differ
    assert not torch.allclose(causal, want, atol=1e-2)


def test_chunks_that_keep_images_whole_and_mixed_batches_are_exact(
    adapter: ModelAdapter,
) -> None:
    prompt = adapter.render_chat(_messages(tiny_image(5), tiny_image(6)))
    ids, images = prompt.token_ids, prompt.images
    whole = _fresh(adapter, ids, images)
    first, second = images
    # chunk ends at the first image's end and at the second image's start
    for cut in (first.end, second.start, first.start):
        kv = adapter.new_kv_buffer(len(ids))
        adapter.forward_batch([SeqChunk(kv, 0, ids[:cut], False, images=images)])
        rest = adapter.forward_batch([SeqChunk(kv, cut, ids[cut:], True, True, images=images)])
        assert torch.equal(rest[0], whole), cut
    with pytest.raises(ValueError, match="ends inside the image"):
        cut = first.start + 5
        kv = adapter.new_kv_buffer(len(ids))
        adapter.forward_batch([SeqChunk(kv, 0, ids[:cut], False, images=images)])
    text = [3 + (5 * i) % 400 for i in range(30)]
    alone = _fresh(adapter, text, ())
    both = adapter.forward_batch(
        [
            SeqChunk(adapter.new_kv_buffer(30), 0, text, True),
            SeqChunk(adapter.new_kv_buffer(len(ids)), 0, ids, True, images=images),
        ]
    )
    assert torch.equal(both[0], alone) and torch.equal(both[1], whole)


def test_a_restored_prefix_ending_inside_an_image_is_exact(adapter: ModelAdapter) -> None:
    """The cache only holds image KV computed with the whole image (no chunk ends inside
    one), so a prefix restored up to any token of the image is the fresh KV there; the
    chunk after it starts inside the image and its rows see the image's restored keys
    causally and its own both ways. Here the restore is the whole prompt's KV cut at
    `cut`, the sliding layers' keys before `cut - window` zeroed as a restore leaves them."""
    prompt = adapter.render_chat(_messages(tiny_image(7), text="A longer question first: "))
    ids, images = prompt.token_ids, prompt.images
    (image,) = images
    kv_whole = adapter.new_kv_buffer(len(ids))
    whole = adapter.forward_batch([SeqChunk(kv_whole, 0, ids, True, images=images)])[0]
    sliding = [i for i, w in enumerate(adapter.kinds.kv_windows) if w is not None]
    for cut in (image.start + 1, image.start + 9, image.end - 1):
        kv = adapter.new_kv_buffer(len(ids))
        kv.zero_()
        kv[:, :, :, :cut] = kv_whole[:, :, :, :cut]
        kv[sliding, :, :, : max(0, cut - GEMMA_WINDOW)] = 0
        got = adapter.forward_batch([SeqChunk(kv, cut, ids[cut:], True, True, images=images)])
        assert torch.equal(got[0], whole), cut
        # a prefix computed by a chunk that ended there (image keys seen causally only)
        # is not the fresh KV: that is what the chunk rule keeps out of the cache
        bad = adapter.new_kv_buffer(len(ids))
        causal = [ImageSpan(s.start, s.end, s.key, s.pixels) for s in images]
        adapter.forward_batch([SeqChunk(bad, 0, ids[:cut], False, images=causal)])
        wrong = adapter.forward_batch([SeqChunk(bad, cut, ids[cut:], True, True, images=images)])
        assert not torch.allclose(wrong[0], whole, atol=1e-3), cut


def test_whole_image_take_never_ends_a_chunk_inside_an_image() -> None:
    pixels = torch.zeros(1)
    both = ImageSpan(10, 26, b"k", pixels, bidirectional=True)
    causal = ImageSpan(10, 26, b"k", pixels)
    assert whole_image_take(0, 15, [both]) == 10  # stops at the image's start
    assert whole_image_take(0, 10, [both]) == 10 and whole_image_take(0, 26, [both]) == 26
    assert whole_image_take(10, 4, [both]) == 16  # stretched past the budget to its end
    assert whole_image_take(14, 4, [both]) == 12  # from inside (a restore) to its end
    assert whole_image_take(0, 15, [causal]) == 15  # LLaVA: any cut
    second = ImageSpan(30, 46, b"l", pixels, bidirectional=True)
    assert whole_image_take(26, 10, [both, second]) == 4
