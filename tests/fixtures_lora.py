"""Tiny PEFT LoRA adapters for the tiny test models, made with `peft` in the test run.

`make_lora(base_dir, out_dir, seed=0, r=4, targets=("q_proj", "v_proj"))` saves an
adapter with random A and non-zero random B (PEFT's own init makes B zero, which
changes nothing), scaled so that greedy answers differ from the base model's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["base_model", "make_lora"]


@functools.lru_cache(maxsize=4)
def base_model(base_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir)


def make_lora(
    base_dir: Path,
    out_dir: Path,
    seed: int = 0,
    r: int = 4,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    alpha: int | None = None,
    strength: float = 0.5,
) -> Path:
    """Write a PEFT LoRA adapter for the model in `base_dir` to `out_dir`."""
    import copy

    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base_model(base_dir))
    config = LoraConfig(
        r=r, lora_alpha=alpha or 2 * r, target_modules=list(targets), init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * strength)
    peft_model.save_pretrained(out_dir)
    return out_dir
