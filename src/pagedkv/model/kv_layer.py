"""A transformers cache layer that appends in place."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class GrowableLayer(DynamicLayer):
    """A full-attention cache layer that appends in place.

    transformers' DynamicLayer concatenates its whole history with every new
    token: at 4K tokens of context that copy is most of a decode step. This
    layer writes new keys and values into a buffer with spare room and hands
    attention a view of the filled part; when the buffer is full it doubles
    (amortised O(1) per token). `keys`/`values` stay `[batch, heads, tokens,
    head_dim]` views, so everything that reads a DynamicLayer reads this one.
    """

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, k = self.get_seq_length(), key_states.shape[-2]
        if self._k is None or self._v is None or n + k > self._k.shape[-2]:
            self._grow(n + k, key_states)
        assert self._k is not None and self._v is not None
        self._k[..., n : n + k, :].copy_(key_states)
        self._v[..., n : n + k, :].copy_(value_states)
        self.keys, self.values = self._k[..., : n + k, :], self._v[..., : n + k, :]
        return self.keys, self.values

    def _grow(self, need: int, like: torch.Tensor) -> None:
        n = self.get_seq_length()
        old = 0 if self._k is None else self._k.shape[-2]
        shape = (*like.shape[:-2], max(need, self.capacity, 2 * old), like.shape[-1])
        k = torch.empty(shape, dtype=like.dtype, device=like.device)
        v = torch.empty(shape, dtype=like.dtype, device=like.device)
        if n:
            assert self.keys is not None and self.values is not None
            k[..., :n, :].copy_(self.keys)
            v[..., :n, :].copy_(self.values)
        self._k, self._v = k, v

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Use `keys`/`values` `[batch, heads, capacity, head_dim]` as this layer's
        buffers, their first `length` tokens already filled by the caller."""
        self.device = keys.device
        self._k, self._v = keys, values
        self.keys, self.values = keys[..., :length, :], values[..., :length, :]
        self.is_initialized = True

    def set_length(self, length: int) -> None:
        """Declare the first `length` tokens of the buffers filled (by `adopt`'s caller)."""
        assert self._k is not None and self._v is not None
        self.adopt(self._k, self._v, length)

    def reset(self) -> None:
        super().reset()
        self._k = self._v = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._k = self._v = None  # `keys` no longer views the buffer

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._k = self._v = None
