"""Model adapter: Hugging Face causal LMs, the bundled default model, KV-cache plumbing.

The adapter's names load on first use: importing a light module of this package (the
LoRA reader, the fingerprint, the GGUF converter) then costs no transformers import,
which `pagedkv cache` commands would otherwise pay (~3 s) for nothing."""

from typing import TYPE_CHECKING, Any

from pagedkv.model.bundled import BUNDLED_MODEL_NAME

if TYPE_CHECKING:
    from pagedkv.model.hf import KV_LAYOUT_VERSION, ModelAdapter, load_model

__all__ = ["BUNDLED_MODEL_NAME", "KV_LAYOUT_VERSION", "ModelAdapter", "load_model"]
_FROM_HF = ("KV_LAYOUT_VERSION", "ModelAdapter", "load_model")


def __getattr__(name: str) -> Any:
    if name in _FROM_HF:
        from pagedkv.model import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
