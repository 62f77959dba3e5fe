"""Tiny random VLMs built in the test run: LLaVA (CLIP vision tower, Llama language
model) and Qwen2-VL (its own vision tower, M-RoPE language model).

`make_tiny_llava(path, seed=0)` writes a LlavaForConditionalGeneration whose vision
tower sees 32x32 images in 8x8 patches (16 placeholder tokens per image), a projector
to the 64-wide, 2-layer Llama of `fixtures_models`, the tiny byte-level tokenizer with
an `<image>` token, a CLIP image processor (PIL backend) and a chat template that reads
list content, to `path`. `make_tiny_qwen2_vl(path, seed=0)` writes a Qwen2VLForConditionalGeneration
whose image processor resizes to multiples of 8 pixels within 8x8..32x32 in 4x4
patches merged 2x2 (a 40x36 image: a 3x3 token grid), a 2-layer 64-wide language model
with M-RoPE, the same tokenizer with Qwen's vision tokens and a chat template that
writes `<|vision_start|><|image_pad|><|vision_end|>` per image. Nothing downloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fixtures_models import _scale_init, make_tiny_tokenizer

__all__ = [
    "GEMMA_IMAGE_TOKENS",
    "GEMMA_WINDOW",
    "IMAGE_TOKENS",
    "QWEN_CHAT_TEMPLATE",
    "VISION_CHAT_TEMPLATE",
    "make_tiny_gemma3",
    "make_tiny_llava",
    "make_tiny_qwen2_vl",
    "tiny_gemma3_dir",
    "tiny_image",
    "tiny_llava_dir",
    "tiny_qwen2_5_vl_dir",
    "tiny_qwen2_vl_dir",
]

IMAGE_SIZE, PATCH = 32, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2  # the CLS row is dropped ("default" strategy)

VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_CHAT_TEMPLATE = VISION_CHAT_TEMPLATE.replace(
    "<image>", "<|vision_start|><|image_pad|><|vision_end|>"
)


def make_tiny_llava(path: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import (
        CLIPVisionConfig,
        GenerationConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(add_bos=True, chat_template=VISION_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=bos,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_id,
        vision_feature_select_strategy="default", vision_feature_layer=-1,
        image_seq_length=IMAGE_TOKENS,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    _scale_init(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=PATCH,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=VISION_CHAT_TEMPLATE, image_token="<image>",
    )  # fmt: skip
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def make_tiny_qwen2_vl(path: str | Path, seed: int = 0, family: str = "qwen2_vl") -> Path:
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(add_bos=True, chat_template=QWEN_CHAT_TEMPLATE)
    names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": names})
    start, image, end, video = (tokenizer.convert_tokens_to_ids(t) for t in names)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "mrope_section": [2, 3, 3]},
        bos_token_id=bos, eos_token_id=eos, pad_token_id=bos,
    )  # fmt: skip
    vision: dict[str, Any] = dict(
        depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    if family == "qwen2_5_vl":  # window attention over 2x2 merged tokens, then full
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      window_size=16, fullatt_block_indexes=[1])  # fmt: skip
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    else:
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    config = config_class(
        text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
        vision_start_token_id=start, vision_end_token_id=end, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    _scale_init(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    images = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=32 * 32
    )
    model.save_pretrained(path)
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_image(seed: int, size: tuple[int, int] = (40, 36)) -> Any:
    """An ImageInput of random pixels (`size` is width, height)."""
    import numpy as np
    from PIL import Image

    from pagedkv.model.images import image_from_pixels

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return image_from_pixels(Image.fromarray(pixels))


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA with its processor (16 placeholder tokens per image)."""
    return make_tiny_llava(tmp_path_factory.mktemp("tiny-llava") / "model")


# ---- Gemma 3 -------------------------------------------------------------------

GEMMA_IMAGE_TOKENS = 16  # 4x4 patches of a 32x32 image, pooled 1:1 (mm_tokens_per_image)
# Shorter than every image prompt, so the sliding layers drop keys the global one keeps.
GEMMA_WINDOW = 12

GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def make_tiny_gemma3(path: str | Path, seed: int = 0) -> Path:
    """A Gemma3ForConditionalGeneration: a 2-layer SigLIP tower on 32x32 images in 8x8
    patches (16 image tokens), a 4-layer Gemma 3 text model (3 sliding layers of window
    `GEMMA_WINDOW`, then a global one), begin/end-of-image tokens around each image's
    run, the Gemma 3 processor with pan-and-scan off, and a Gemma-style chat template."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        GenerationConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(add_bos=True, chat_template=GEMMA_CHAT_TEMPLATE)
    marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>"}  # fmt: skip
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [*marks.values(), "<start_of_turn>", "<end_of_turn>"]}
    )
    tokenizer._set_model_specific_special_tokens(marks)  # boi_token, ... and their ids
    image_id = tokenizer.convert_tokens_to_ids(marks["image_token"])
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False,
    )  # fmt: skip
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=GEMMA_WINDOW, sliding_window_pattern=4,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=bos,
    )  # fmt: skip
    config = Gemma3Config(
        vision_config=vision.to_dict(), text_config=text.to_dict(),
        mm_tokens_per_image=GEMMA_IMAGE_TOKENS, image_token_index=image_id,
        boi_token_index=tokenizer.convert_tokens_to_ids(marks["boi_token"]),
        eoi_token_index=tokenizer.convert_tokens_to_ids(marks["eoi_token"]),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    _scale_init(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos)
    images = Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_pan_and_scan=False
    )
    processor = Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, chat_template=GEMMA_CHAT_TEMPLATE,
        image_seq_length=GEMMA_IMAGE_TOKENS,
    )  # fmt: skip
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 VLM with its processor (16 image tokens per image, sliding
    window 12)."""
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3") / "model")


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-VL with its image processor (a 40x36 image: 9 placeholder tokens)."""
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl") / "model")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-VL (window attention in its vision tower), as `tiny_qwen2_vl_dir`."""
    path = tmp_path_factory.mktemp("tiny-qwen2-5-vl") / "model"
    return make_tiny_qwen2_vl(path, family="qwen2_5_vl")
