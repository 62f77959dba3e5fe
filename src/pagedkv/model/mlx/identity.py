"""What names an MLX model's KV in the namespace (`cache.identity`): the backend, its
library versions and kernels, the device, and the weights as stored.

The backend field alone keeps torch KV and MLX KV apart: the same weights computed
by another library round otherwise, and mlx-lm's implementation of an architecture
can differ from transformers' (its Mistral ignores `sliding_window` unless
`layer_types` says so). The weights digest is `model.fingerprint.weights_digest`
over the files as stored, so a 4-bit and an 8-bit quantization of one model, and
the float weights they came from, are three namespaces.
"""

from __future__ import annotations

import hashlib
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from pagedkv.model.fingerprint import canonical_config, files_weights_digest

BACKEND = "mlx"
# mlx-lm's models call this for every attention; decode rows of several sequences
# attend their zero-padded keys under a mask (`seq_kv.DecodeLayer`).
ATTENTION = "mlx.fast.scaled_dot_product_attention:decode=padded-masked"


class JsonConfig:
    """A config.json read as a dict, with the `to_dict` `canonical_config` reads."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


def device_name() -> str:
    """The device MLX computes on: `cpu` (mlx-cpu, or the CPU of a Mac) or `gpu` (Metal)."""
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def linear_kernel(config: dict[str, Any]) -> str:
    """MLX's matrix products: dense, or quantized with the config's bits and group size."""
    quant = config.get("quantization") or config.get("quantization_config")
    base = f"mlx-{version('mlx')}"
    if isinstance(quant, dict):
        fields = ",".join(
            f"{k}={quant[k]}" for k in sorted(quant) if not isinstance(quant[k], dict)
        )
        return f"{base}:quantized({fields})"
    return f"{base}:dense"


def attention_kernel() -> str:
    """The attention kernel and the library whose model code calls it."""
    return f"{ATTENTION}:mlx-{version('mlx')}:mlx-lm-{version('mlx-lm')}"


def mlx_weights_digest(model: Any, model_dir: Path | None) -> str:
    """The files' digest where the model came from files (quantized tensors as stored);
    else the sha256 of its parameters, by name, dtype and shape."""
    digest = files_weights_digest(model_dir) if model_dir is not None else None
    if digest is not None:
        return digest
    h = hashlib.sha256()
    params: list[tuple[str, Any]] = list(tree_flatten(model.parameters()))  # type: ignore[arg-type]
    for name, array in sorted(params, key=lambda p: p[0]):
        h.update(f"{name}|{array.dtype}|{tuple(array.shape)}\0".encode())
        raw = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
        h.update(np.ascontiguousarray(np.array(raw)).tobytes())
    return "tensors:" + h.hexdigest()


def config_field(config: dict[str, Any]) -> str:
    """The namespace's `config` field, by the same rule as the torch backend's."""
    return canonical_config(JsonConfig(config))
