"""Images in the prompt: a vision-language model's processor, its encoder rows, and
the spans that key an image's placeholder tokens.

A VLM directory (a config with a `vision_config`, of a family in `VISION_FAMILIES`) is
loaded with `AutoModelForImageTextToText` and `AutoProcessor`. Its language model runs
through the ragged batch like any text model; this module adds what images need:

- `render`: chat messages whose content holds image parts (`{"type": "image", "image":
  ImageInput}`) go through the processor's chat template and the processor, which
  expands each image's placeholder into its tokens. The result is the prompt's ids and
  one `ImageSpan` per image: the range `[start, end)` of its placeholder tokens, its
  processed pixels and its `key` = sha256(tag | pixel digest | processor fingerprint).
- `image_segments`: the spans as the hash chain's segments (`cache.hashing.ExtraKeys`),
  so every block from the one an image starts in on carries it; two images with the
  same placeholder tokens get other block keys from that block on.
- `embed`: for a step whose rows cover placeholder positions, the input embeddings
  with those rows replaced by the image's encoder rows (a chunk may start inside an
  image: the rows are sliced at its offset). Encoder rows come from the `VisionCache`.

Served, all with placeholder tokens that each take one encoder row in order: LLaVA
(1-D positions, causal), Qwen2-VL and Qwen2.5-VL (M-RoPE positions from each image's
grid, `model.mrope`; their processor and patch grids, `model.vision_qwen`), and Gemma 3,
whose image tokens attend to each other both ways (`ImageSpan.bidirectional`,
`images_attend_both_ways`): the ragged batch's prompt mask lets an image's rows see all
of its keys, and no prefill chunk ends inside such an image (`whole_image_take`).
A prefix cached up to any token inside an image then holds exactly the KV a fresh
prompt computes there. docs/architecture.md,
"Images".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.errors import ImagePromptError, ModelNotSupportedError
from pagedkv.model.images import ImageInput
from pagedkv.model.vision_cache import DEFAULT_VISION_CACHE_BYTES, VisionCache
from pagedkv.model.vision_qwen import QWEN_FAMILIES, load_patch_processor, split_patches

# Model types whose image tokens pagedkv serves (see the module docstring).
VISION_FAMILIES = frozenset({"llava", "gemma3"}) | QWEN_FAMILIES
# Families whose image tokens attend to each other both ways (transformers builds their
# mask from `token_type_ids`: causal, or-ed with "same run of image tokens").
_BIDIRECTIONAL_FAMILIES = frozenset({"gemma3"})
_KEY_TAG = b"pagedkv-image-key-v1\x00"
_SEGMENT_TAG = b"pagedkv-image-segments-v1\x00"
# Processor fields that never change an image's tokens or rows.
_NOT_SHAPING = frozenset({"chat_template", "processor_class", "auto_map", "tokenizer"})


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """One image of a prompt: its placeholder tokens `[start, end)`, its processed
    `pixels` (the encoder's input for this image alone) and its `key` (the pixels'
    digest with the processor's fingerprint: what names its encoder rows)."""

    start: int
    end: int
    key: bytes
    pixels: torch.Tensor
    # The encoder's patch grid `(t, h, w)` for this image (Qwen2-VL's `image_grid_thw`
    # row); None where the encoder takes a fixed-size image.
    grid_thw: tuple[int, int, int] | None = None
    # Its token grid `(t, h, w)`, whose places are its tokens' M-RoPE positions
    # (`model.mrope`); None: 1-D positions.
    rope_grid: tuple[int, int, int] | None = None
    # The image's tokens attend to each other both ways (Gemma 3): a prefill chunk must
    # never end inside it, and its rows see its keys past their own position.
    bidirectional: bool = False

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A rendered conversation: its token ids and its images in prompt order."""

    token_ids: list[int]
    images: tuple[ImageSpan, ...] = ()


def is_vision_config(config: Any) -> bool:
    """Whether a transformers config is a VLM pagedkv serves with images."""
    return (
        getattr(config, "vision_config", None) is not None
        and getattr(config, "model_type", None) in VISION_FAMILIES
    )


def images_attend_both_ways(config: Any) -> bool:
    """Whether a VLM's image tokens attend to each other both ways (Gemma 3), read from
    its model type: transformers' Gemma 3 ors the causal mask with "same run of image
    tokens" in every layer, sliding ones included (there the window still applies)."""
    return getattr(config, "model_type", None) in _BIDIRECTIONAL_FAMILIES


def whole_image_take(start: int, take: int, images: Sequence[ImageSpan]) -> int:
    """How many of `take` tokens from `start` a prefill chunk computes so that it never
    ends inside an image whose tokens attend both ways: the chunk stops at the image's
    start, or when it would then compute nothing, runs past the budget to the image's
    end (an image is computed whole; Gemma 3's have 256 tokens)."""
    end = start + take
    for span in images:
        if span.bidirectional and span.start < end < span.end:
            return span.start - start if span.start > start else span.end - start
    return take


def image_segments(images: Sequence[ImageSpan]) -> tuple[tuple[int, bytes], ...]:
    """The hash chain's segments: one per image, at its first token. Each key folds in
    every earlier image's key too: a block takes only the last segment starting in it,
    and two images starting in one block must both name it."""
    out = []
    key = b""
    for span in images:
        key = hashlib.sha256(_SEGMENT_TAG + key + span.key).digest()
        out.append((span.start, key))
    return tuple(out)


def processor_fingerprint(processor: Any) -> bytes:
    """sha256 of the processor's settings that shape an image's tokens and pixels (its
    image processor's sizes, resampling, normalization; patch size, feature strategy,
    placeholder token) and its image processor's class (transformers' PIL and torchvision
    backends share their settings but resize to other pixels), as canonical JSON."""
    fields = {k: v for k, v in processor.to_dict().items() if k not in _NOT_SHAPING}
    fields["image_processor_class"] = type(getattr(processor, "image_processor", None)).__name__
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).digest()


def load_vision_model(directory: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """The VLM in `directory` and its processor, from local files only."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    try:
        model = AutoModelForImageTextToText.from_pretrained(
            directory, dtype=dtype, local_files_only=True
        )
        if getattr(model.config, "model_type", None) in QWEN_FAMILIES:
            processor: Any = load_patch_processor(directory)
        else:
            processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ModelNotSupportedError(
            f"cannot load {str(directory)!r} as a transformers image-text-to-text model "
            f"with its processor: {exc}"
        ) from exc
    return model, processor


class VisionModel:
    """A VLM's image side: rendering with images, encoder rows and their cache.
    Used on the worker thread (`embed`) and the render threads (`render`, which reads
    only the processor)."""

    def __init__(
        self, model: Any, processor: Any, cache_bytes: int = DEFAULT_VISION_CACHE_BYTES
    ) -> None:
        config = model.config
        token_id = getattr(config, "image_token_id", None)
        if token_id is None:
            token_id = getattr(config, "image_token_index", None)
        if not isinstance(token_id, int):
            raise ModelNotSupportedError(
                f"{type(model).__name__}'s config names no image token (image_token_id)"
            )
        self.model = model
        self.processor = processor
        self.image_token_id = token_id
        self.fingerprint = processor_fingerprint(processor)
        self.hidden_size = int(config.get_text_config(decoder=True).hidden_size)
        # Whether image tokens take M-RoPE positions from their grid (`model.mrope`).
        self.mrope = getattr(config, "model_type", None) in QWEN_FAMILIES
        self.cache = VisionCache(cache_bytes)
        self.bidirectional = images_attend_both_ways(config)
        pan_and_scan = getattr(getattr(processor, "image_processor", None), "do_pan_and_scan", None)
        if pan_and_scan:
            raise ModelNotSupportedError(
                f"{type(processor).__name__} has do_pan_and_scan on: its crops add images "
                "of their own to a prompt; set it false in preprocessor_config.json"
            )

    def image_key(self, image: ImageInput) -> bytes:
        """What names an image's tokens and encoder rows under this processor."""
        return hashlib.sha256(_KEY_TAG + image.digest + self.fingerprint).digest()

    # ---- rendering (any thread) -------------------------------------------

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        check: Callable[[str], None] | None = None,
        **kwargs: Any,
    ) -> ImagePrompt:
        """The conversation through the processor's chat template and the processor: its
        ids, each image's placeholder expanded, and the images' spans. `check` sees the
        template's text before the processor tokenizes it (a length bound)."""
        converted, images = template_messages(messages)
        text = self.processor.apply_chat_template(
            converted, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        if check is not None:
            check(str(text))
        placeholder = getattr(self.processor, "image_token", None)
        if isinstance(placeholder, str) and str(text).count(placeholder) != len(images):
            raise ImagePromptError(
                f"the rendered conversation holds {str(text).count(placeholder)} image "
                f"placeholders {placeholder!r} for {len(images)} images: a text part "
                "contains the placeholder itself; remove it from the text"
            )
        pil = [image.pixels for image in images]
        out = self.processor(
            text=text, images=pil or None, add_special_tokens=False, return_tensors="pt"
        )
        ids = [int(i) for i in out["input_ids"][0]]
        if not images:
            return ImagePrompt(ids)
        return ImagePrompt(ids, self._spans(ids, images, out))

    def _spans(self, ids: list[int], images: list[ImageInput], out: Any) -> tuple[ImageSpan, ...]:
        pixels = out["pixel_values"]
        grids = out.get("image_grid_thw")
        Grid = tuple[int, int, int] | None
        parts: list[tuple[torch.Tensor, Grid, Grid]]
        if grids is not None:  # a flat run of patches, split by each image's grid
            merge = int(self.processor.merge_size)
            split = split_patches(pixels, grids, merge)
            counts = [t * h * w for _, _, (t, h, w) in split]
            parts = list(split)
        elif pixels.shape[0] != len(images):
            raise ImagePromptError(
                f"the processor made {pixels.shape[0]} pixel tensors for {len(images)} images"
            )
        else:
            sizes = [(image.size[1], image.size[0]) for image in images]  # (height, width)
            processor = self.processor
            counts = processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
            parts = [(pixels[k : k + 1], None, None) for k in range(len(images))]
        where = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        if len(where) != sum(counts):
            raise ImagePromptError(
                f"the prompt holds {len(where)} image placeholder tokens where its "
                f"{len(images)} images take {sum(counts)}: does a text part contain the "
                "image placeholder itself? Remove it from the text"
            )
        spans = []
        first = 0
        for k, (image, count) in enumerate(zip(images, counts, strict=True)):
            run = where[first : first + count]
            if run[-1] - run[0] != count - 1:
                raise ImagePromptError(f"image {k}'s placeholder tokens are not contiguous")
            first += count
            key = self.image_key(image)
            patches, grid_thw, rope_grid = parts[k]
            span = ImageSpan(
                int(run[0]), int(run[-1]) + 1, key, patches, grid_thw, rope_grid,
                bidirectional=self.bidirectional,
            )  # fmt: skip
            spans.append(span)
        return tuple(spans)

    # ---- encoder rows (worker thread) ---------------------------------------

    def features(self, span: ImageSpan) -> torch.Tensor:
        """The image's encoder rows `[num_tokens, hidden]`, from the cache or computed."""
        rows = self.cache.get(span.key)
        if rows is not None:
            return rows
        param = next(self.model.parameters())
        self.cache.encoder_calls += 1
        pixels = span.pixels.to(device=param.device, dtype=param.dtype)
        kwargs: dict[str, Any] = {}
        if span.grid_thw is not None:
            kwargs["image_grid_thw"] = torch.tensor([span.grid_thw], device=param.device)
        out = self.model.get_image_features(pixel_values=pixels, return_dict=True, **kwargs)
        rows = torch.cat(list(out.pooler_output)).reshape(-1, self.hidden_size)
        if rows.shape[0] != span.num_tokens:
            raise ImagePromptError(
                f"the vision encoder made {rows.shape[0]} rows for an image of "
                f"{span.num_tokens} placeholder tokens"
            )
        self.cache.put(span.key, rows)
        return rows

    def embed(
        self, ids: torch.Tensor, placed: Sequence[tuple[int, ImageSpan, int, int]]
    ) -> torch.Tensor:
        """Input embeddings of `ids` `[1, rows]`, where each `(row, span, a, b)` puts the
        span's encoder rows `[a, b)` at batch rows `[row, row + b - a)`."""
        embeds = self.model.get_input_embeddings()(ids)
        for row, span, a, b in placed:
            embeds[0, row : row + b - a] = self.features(span)[a:b].to(embeds.dtype)
        return embeds


def placements(
    chunks: Sequence[Any], offsets: Sequence[int]
) -> list[tuple[int, ImageSpan, int, int]]:
    """Where images' rows go in a step: `(batch row, span, first row, end row)` for each
    image a chunk's positions overlap (a chunk may start or end inside an image)."""
    placed = []
    for chunk, first in zip(chunks, offsets, strict=True):
        start, end = chunk.start, chunk.start + len(chunk.token_ids)
        for span in chunk.images:
            low, high = max(span.start, start), min(span.end, end)
            if low < high:
                placed.append((first + low - start, span, low - span.start, high - span.start))
    return placed


def template_messages(
    messages: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """Messages as processors' chat templates read them (content always a list of
    parts, an image part without its pixels) and the images in order."""
    converted: list[dict[str, Any]] = []
    images: list[ImageInput] = []
    for message in messages:
        content = message.get("content")
        if content is None or isinstance(content, str):
            parts = [] if content is None else [{"type": "text", "text": content}]
        else:
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "image":
                    image = part.get("image")
                    if not isinstance(image, ImageInput):
                        raise ImagePromptError("an image part must carry a decoded ImageInput")
                    images.append(image)
                    parts.append({"type": "image"})
                elif kind == "text":
                    parts.append({"type": "text", "text": str(part.get("text", ""))})
                else:
                    raise ImagePromptError(f"unknown content part type {kind!r}")
        converted.append({**message, "content": parts})
    return converted, images


def has_images(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether any message's content holds an image part."""
    return any(
        isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
        for m in messages
    )
