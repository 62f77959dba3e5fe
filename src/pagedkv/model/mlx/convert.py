"""KV across the seam: MLX arrays to the torch CPU tensors the pool and tiers hold, and back.

Both sides hold the same bits: a conversion copies bytes, it never rounds. numpy has no
bfloat16, so bfloat16 crosses as its raw 16 bits (a uint16 view on both sides).
Rejected: a cast through float32, which is exact for bfloat16 too but doubles the
bytes copied and gives a reader of the code one more place to wonder about rounding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
_TORCH_OF = {mx.float32: torch.float32, mx.bfloat16: torch.bfloat16, mx.float16: torch.float16}


def torch_dtype(dtype: mx.Dtype) -> torch.dtype:
    """The torch dtype holding the same bits as MLX's `dtype` (a float dtype)."""
    if dtype not in _TORCH_OF:
        raise TypeError(f"no torch dtype for MLX {dtype}; KV must be float32, bfloat16 or float16")
    return _TORCH_OF[dtype]


def mx_dtype(dtype: torch.dtype) -> mx.Dtype:
    """The MLX dtype holding the same bits as torch's `dtype` (a float dtype)."""
    return MX_DTYPES[str(dtype).removeprefix("torch.")]


def to_torch(array: mx.array) -> torch.Tensor:
    """A CPU torch tensor with `array`'s values and dtype (a copy)."""
    if array.dtype == mx.bfloat16:
        raw = np.array(array.view(mx.uint16), copy=True)
        return torch.from_numpy(raw).view(torch.bfloat16)
    return torch.from_numpy(np.array(array, copy=True))


def to_mx(tensor: torch.Tensor) -> mx.array:
    """An MLX array with a CPU torch tensor's values and dtype (a copy)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return mx.array(tensor.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(tensor.numpy())
