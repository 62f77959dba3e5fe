"""The torch backend's `SeqKV`s (`model.backend`): one sequence's KV, two ways.

`BufferKV`: the ragged batch's buffer `[L, 2, kv_heads, capacity, row_width]`
(`ModelAdapter.new_kv_buffer`), already in the seam's format: a restore writes
into it, `kv_of` is a view of it.

`CacheKV`: a transformers cache (`ModelAdapter.new_cache`), for models the
ragged batch cannot run (recurrent and hybrid ones, attention the probe
rejects); `ModelAdapter.forward` runs it one sequence at a time. Its attention
layers grow by themselves, so `capacity` is only what the engine reserved. The
cache is made on first use: with the KV buffers a restore writes into
(`cache_with_buffers`) when `restore_target` is asked for, else plain
(`new_cache`) at the first forward, as the engine made them before this seam.
"""

from __future__ import annotations

import copy as _copy
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagedkv.model.hf import ModelAdapter


class BufferKV:
    """A ragged-batch sequence's KV buffer; `buffer[:, :, :, :n]` holds its first n tokens."""

    __slots__ = ("_new", "buffer")

    def __init__(self, buffer: torch.Tensor, new: Any) -> None:
        self.buffer = buffer
        self._new = new  # capacity -> an empty buffer (`ModelAdapter.new_kv_buffer`)

    @property
    def capacity(self) -> int:
        return int(self.buffer.shape[3])

    def restore_target(self) -> torch.Tensor:
        return self.buffer

    def set_restored(self, num_tokens: int, state: torch.Tensor | None) -> None:
        if state is not None:
            raise ValueError("the ragged batch runs no model with recurrent state")

    def kv_of(self, start: int, end: int) -> torch.Tensor:
        return self.buffer[:, :, :, start:end]

    def grown(self, capacity: int, num_tokens: int) -> BufferKV:
        return self.copy(num_tokens, capacity)

    def copy(self, num_tokens: int, capacity: int) -> BufferKV:
        out = BufferKV(self._new(capacity), self._new)
        out.buffer[:, :, :, :num_tokens].copy_(self.buffer[:, :, :, :num_tokens])
        return out

    def snapshot(self) -> torch.Tensor:
        raise ValueError("the ragged batch runs no model with recurrent state")


class CacheKV:
    """A sequence's transformers cache; see the module docstring."""

    __slots__ = ("_adapter", "_capacity", "cache")

    def __init__(self, adapter: ModelAdapter, capacity: int, cache: Any = None) -> None:
        self._adapter = adapter
        self._capacity = capacity
        self.cache = cache

    @property
    def capacity(self) -> int:
        return self._capacity

    def restore_target(self) -> torch.Tensor:
        if self.cache is not None:
            raise RuntimeError("restore_target after the cache was made: restore comes first")
        self.cache, buffers = self._adapter.cache_with_buffers(self._capacity)
        return buffers

    def set_restored(self, num_tokens: int, state: torch.Tensor | None) -> None:
        adapter = self._adapter
        adapter.set_cache_length(self.cache, num_tokens)
        if state is not None and adapter.state_layout is not None:
            adapter.state_layout.load(self.cache, state, adapter.device)

    def for_forward(self) -> Any:
        """The cache the next forward appends to (made now if nothing restored into it)."""
        if self.cache is None:
            self.cache = self._adapter.new_cache(self._capacity)
        return self.cache

    def kv_of(self, start: int, end: int) -> torch.Tensor:
        layers = self._adapter.cache_layers(self.for_forward())
        return torch.stack(
            [torch.stack((k[0, :, start:end], v[0, :, start:end])) for k, v in layers]
        )

    def grown(self, capacity: int, num_tokens: int) -> CacheKV:
        self._capacity = capacity  # the layers grow by themselves, as they append
        return self

    def copy(self, num_tokens: int, capacity: int) -> CacheKV:
        return CacheKV(self._adapter, capacity, _copy.deepcopy(self.for_forward()))

    def snapshot(self) -> torch.Tensor:
        layout = self._adapter.state_layout
        if layout is None:
            raise ValueError(f"{self._adapter.name} keeps no recurrent state to snapshot")
        return layout.snapshot(self.for_forward())
