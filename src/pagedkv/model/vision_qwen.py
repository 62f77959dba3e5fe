"""Qwen2-VL's and Qwen2.5-VL's image side: their processor, built by pagedkv from its
parts, and their images' spans (a patch grid per image, M-RoPE positions:
`model.mrope`). The two share all of it for images.

Qwen2-VL's processor class (transformers' `Qwen2VLProcessor`) also needs its video
processor, which needs torchvision; pagedkv reads images only, so it builds what it
needs from the directory's image processor, tokenizer and chat template
(`PatchProcessor`): the chat template renders `<|vision_start|><|image_pad|>
<|vision_end|>` per image, and each `<|image_pad|>` is expanded into the image's
`t * h * w / merge^2` tokens, as transformers' processor does. The image processor
resizes each image to multiples of `patch * merge` within its pixel bounds and makes a
flat run of patches for all images, `image_grid_thw` (patches, before the merge) per
image saying how many are whose; an image's encoder input is its own slice with its
grid row, and its tokens' positions follow its grid divided by the merge.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from pagedkv.errors import ImagePromptError, ModelNotSupportedError

# Model types of this module's family.
QWEN_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})
QWEN_IMAGE_TOKEN = "<|image_pad|>"


class PatchProcessor:
    """Qwen2-VL's processor for images: the chat template, the image processor's
    patches and grids, and the placeholder expanded into each image's tokens."""

    def __init__(
        self, image_processor: Any, tokenizer: Any, chat_template: str | None = None
    ) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.image_token = QWEN_IMAGE_TOKEN
        self.merge_size = int(image_processor.merge_size)

    def apply_chat_template(
        self, messages: Any, add_generation_prompt: bool = True, tokenize: bool = False, **kw: Any
    ) -> str:
        if self.chat_template is None:
            raise ModelNotSupportedError("the model's processor has no chat template")
        return str(
            self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kw,
            )
        )

    def __call__(
        self,
        text: str,
        images: list[Any] | None = None,
        add_special_tokens: bool = False,
        return_tensors: str = "pt",
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if images:
            pixels = self.image_processor(images, return_tensors="pt")
            grids = pixels["image_grid_thw"]
            parts = text.split(self.image_token)
            if len(parts) - 1 != len(images):
                raise ImagePromptError(
                    f"the text holds {len(parts) - 1} image placeholders "
                    f"{self.image_token!r} for {len(images)} images"
                )
            counts = [int(g.prod()) // self.merge_size**2 for g in grids]
            text = parts[0] + "".join(
                self.image_token * n + part for n, part in zip(counts, parts[1:], strict=True)
            )
            out = {"pixel_values": pixels["pixel_values"], "image_grid_thw": grids}
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": torch.tensor([ids], dtype=torch.long), **out}

    def to_dict(self) -> dict[str, Any]:
        """What shapes an image's tokens and pixels (`model.vision.processor_fingerprint`),
        the image processor's class among them: its PIL and torchvision backends share
        their settings but resize to other pixels."""
        return {
            "processor_class": type(self).__name__,
            "image_processor_class": type(self.image_processor).__name__,
            "image_processor": self.image_processor.to_dict(),
            "image_token": self.image_token,
            "merge_size": self.merge_size,
        }


def load_patch_processor(directory: Path) -> PatchProcessor:
    """Qwen2-VL's image processor, tokenizer and chat template (the processor's
    `chat_template.jinja` / `chat_template.json`, else the tokenizer's) from `directory`."""
    from transformers import AutoImageProcessor, AutoTokenizer

    images = AutoImageProcessor.from_pretrained(directory, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    template = None
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    elif (directory / "chat_template.json").is_file():
        template = json.loads((directory / "chat_template.json").read_text()).get("chat_template")
    return PatchProcessor(images, tokenizer, template)


def split_patches(
    pixels: torch.Tensor, grids: torch.Tensor, merge_size: int
) -> list[tuple[torch.Tensor, tuple[int, int, int], tuple[int, int, int]]]:
    """Each image's `(patches, grid_thw, rope_grid)`: its slice of the flat run of
    patches, its patch grid (the encoder's `image_grid_thw` row) and its token grid
    (`t, h / merge, w / merge`: its positions, `model.mrope`)."""
    out = []
    first = 0
    for grid in grids.tolist():
        t, h, w = (int(x) for x in grid)
        if h % merge_size or w % merge_size:
            raise ImagePromptError(f"an image's patch grid {grid} does not divide by {merge_size}")
        rope_grid = (t, h // merge_size, w // merge_size)
        out.append((pixels[first : first + t * h * w], (t, h, w), rope_grid))
        first += t * h * w
    if first != pixels.shape[0]:
        raise ImagePromptError(
            f"the processor made {pixels.shape[0]} patches where the images' grids take {first}"
        )
    return out
