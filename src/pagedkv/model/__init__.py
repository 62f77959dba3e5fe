"""Model adapter: Hugging Face causal LMs, the bundled default model, KV-cache plumbing."""

from pagedkv.model.bundled import BUNDLED_MODEL_NAME
from pagedkv.model.hf import KV_LAYOUT_VERSION, ModelAdapter, load_model

__all__ = ["BUNDLED_MODEL_NAME", "KV_LAYOUT_VERSION", "ModelAdapter", "load_model"]
