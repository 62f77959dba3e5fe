"""One sequence's KV on MLX: mlx-lm's cache objects, one per decoder layer.

A sequence keeps mlx-lm's own `KVCache` per attention layer (the objects its models
are written against; a sliding layer's too, its mask keeping the window: `layers`),
wrapped so that KV is stored in the engine's `kv_format` and attention reads the
stored values back, the chunk just computed included: a fresh prefill and a restored
prefix then attend over the same numbers (`model.kv_format`). KV crosses the seam
(`model.backend`) as torch CPU tensors `[L, 2, kv_heads, tokens, head_dim]`; the
conversion copies bytes (`convert`). A recurrent layer keeps mlx-lm's `ArraysCache`;
its arrays cross as one float32 snapshot (`snapshot`, `set_restored`).

`DecodeLayer` puts the decode rows of several sequences into one model call: the
rows are a batch `[B, 1]`, each at its own position (RoPE takes a vector of offsets),
and each layer's new keys and values go into each sequence's own cache; attention
sees every sequence's keys padded with zeros to the longest, and a mask hides the
padding (and, for a sliding layer, the keys before each row's window). Measured on
mlx-cpu 0.32.4 (tests/model/test_mlx_backend.py, tests/model/test_mlx_kinds.py): a
sequence's logits in such a batch equal its logits alone, bit for bit. Rejected:
mlx-lm's `BatchKVCache`, which keeps a batch's KV in one left-padded array across
steps, while the engine's batch changes at every step (sequences join, finish,
prefill).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import torch
from mlx_lm.models.cache import KVCache, _BaseCache

from pagedkv.errors import ModelNotSupportedError
from pagedkv.model.mlx import layers
from pagedkv.model.mlx.convert import to_mx, to_torch
from pagedkv.model.mlx.layers import StoredKVCache, kv_part
from pagedkv.model.state import StateLayout


class MlxSeqKV:
    """A sequence's KV: `caches[i]` is decoder layer i's mlx-lm cache object, and the
    attention layers' caches (`kv_layers`) are `StoredKVCache`s, inside a `CacheList`
    too (`make_caches` makes a fresh set); `state_layout`: the recurrent arrays a
    snapshot holds (None: none). `capacity` is the room the worker budgets; MLX arrays
    grow by themselves, so it is only recorded. Restored KV is written into a torch buffer
    (`restore_target`) and copied into MLX arrays once, in `set_restored`, which
    starts the sequence afresh whatever it still holds, as the seam's contract asks
    (the worker keeps no spare MLX KV: `MlxBackend.reuses_kv` is False)."""

    def __init__(
        self,
        make_caches: Callable[[], list[Any]],
        kv_layers: tuple[int, ...],
        storage: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        state_layout: StateLayout | None = None,
    ) -> None:
        self.make_caches = make_caches
        self.state_layout = state_layout
        self.caches = make_caches()
        self.kv_layers = kv_layers
        self.storage = storage
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._capacity = capacity
        self._length = 0
        self._target: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_tokens(self) -> int:
        """Tokens the sequence's caches hold (counted here: a recurrent or combined
        layer's mlx-lm cache has no offset to read it from)."""
        return self._length

    def advance(self, num_tokens: int) -> None:
        """The model has just run `num_tokens` more tokens through the caches."""
        self._length += num_tokens

    def restore_target(self) -> torch.Tensor:
        if self._target is None:
            shape = (len(self.kv_layers), 2, self.num_kv_heads, self._capacity, self.head_dim)
            self._target = torch.zeros(shape, dtype=self.storage)
        return self._target

    def set_restored(self, num_tokens: int, state: torch.Tensor | None) -> None:
        layout = self.state_layout
        if state is not None and layout is None:
            raise ModelNotSupportedError(
                "a recurrent state was restored into an MLX model that keeps none"
            )
        if num_tokens and layout is not None and state is None:
            raise ValueError(f"a restore of {num_tokens} tokens without the recurrent state")
        target = self.restore_target()
        self.caches = self.make_caches()
        self._length = num_tokens
        if not num_tokens:
            self._target = None
            return
        for row, layer in enumerate(self.kv_layers):
            kv = to_mx(target[row, :, :, :num_tokens])  # [2, H, n, D]
            kv_part(self.caches[layer]).adopt(kv[0][None], kv[1][None])
        if layout is not None and state is not None:
            layers.load(self.caches, layout, state)
        mx.eval([(kv_part(self.caches[i]).keys, kv_part(self.caches[i]).values)
                 for i in self.kv_layers])  # fmt: skip
        self._target = None  # the MLX arrays hold it now

    def kv_of(self, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"kv_of({start}, {end}) of a sequence holding {self.num_tokens}")
        rows = []
        for i in self.kv_layers:
            part = kv_part(self.caches[i])
            assert part.keys is not None and part.values is not None
            rows.append(mx.stack([part.keys[0, :, start:end], part.values[0, :, start:end]]))
        return to_torch(mx.stack(rows))

    def rewind(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` only: a chunk starts there (0: afresh, whatever
        it held)."""
        held = self.num_tokens
        if num_tokens > held:
            raise ValueError(f"a chunk at {num_tokens} of a sequence holding {held} tokens")
        if num_tokens == held:
            return
        if not num_tokens:
            self.caches, self._length = self.make_caches(), 0
            return
        for i, cache in enumerate(self.caches):
            if not isinstance(cache, KVCache) or not cache.is_trimmable():
                raise ValueError(f"layer {i}'s {type(cache).__name__} cannot rewind")
            cache.trim(held - num_tokens)
        self._length = num_tokens

    def grown(self, capacity: int, num_tokens: int) -> MlxSeqKV:
        self.rewind(num_tokens)
        self._capacity = max(self._capacity, capacity)
        return self

    def copy(self, num_tokens: int, capacity: int) -> MlxSeqKV:
        fork = MlxSeqKV(
            self.make_caches, self.kv_layers, self.storage, self.num_kv_heads, self.head_dim,
            capacity, self.state_layout,
        )  # fmt: skip
        if not num_tokens:
            return fork
        fork._length = num_tokens
        if num_tokens > self.num_tokens:
            raise ValueError(
                f"a fork of {num_tokens} tokens of a sequence holding {self.num_tokens}"
            )
        for i, cache in enumerate(self.caches):
            if isinstance(cache, StoredKVCache):
                assert cache.keys is not None and cache.values is not None
                # Slices are new arrays: the fork's writes never reach this sequence's.
                keys, values = cache.keys[..., :num_tokens, :], cache.values[..., :num_tokens, :]
                fork.caches[i].adopt(keys, values)
            elif num_tokens == self.num_tokens:  # a sliding window or a recurrent state
                fork.caches[i] = _clone(cache)
            else:
                raise ModelNotSupportedError(
                    f"cannot fork the first {num_tokens} of {self.num_tokens} tokens of an MLX "
                    f"sequence whose layer {i} keeps a {type(cache).__name__}"
                )
        return fork

    def snapshot(self) -> torch.Tensor:
        """Every recurrent array after the computed tokens, one float32 tensor (`layers`)."""
        if self.state_layout is None:
            raise ModelNotSupportedError("this MLX model keeps no recurrent state to snapshot")
        return layers.snapshot(self.caches, self.state_layout)


def _clone(cache: Any) -> Any:
    """A copy of an mlx-lm cache object whose arrays are copies: mlx-lm updates its
    arrays in place (`keys[..., i:j, :] = ...`), which would reach a shared array."""
    clone = copy.copy(cache)
    for name, value in vars(cache).items():
        setattr(clone, name, _copied(value))
    return clone


def _copied(value: Any) -> Any:
    """Arrays copied, caches cloned (a `CacheList` holds caches), in lists and tuples too."""
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list | tuple):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, _BaseCache):
        return _clone(value)
    return value


class DecodeLayer:
    """One decoder layer's cache for a step of decode rows, one row per sequence (see the
    module docstring). mlx-lm's attention calls `update_and_fetch` with the batch's new
    keys `[B, kv_heads, 1, head_dim]` and asks `make_mask` for the mask."""

    def __init__(self, caches: list[StoredKVCache], positions: list[int]) -> None:
        self.caches = caches
        self.offset = mx.array(positions)
        self.lengths = [p + 1 for p in positions]
        self.longest = max(self.lengths)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        padded_keys, padded_values = [], []
        for i, cache in enumerate(self.caches):
            k, v = cache.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            pad = self.longest - k.shape[2]
            if pad:
                # Zeros: masked keys must still be finite numbers.
                k = mx.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)])
                v = mx.pad(v, [(0, 0), (0, 0), (0, pad), (0, 0)])
            padded_keys.append(k)
            padded_values.append(v)
        return mx.concatenate(padded_keys), mx.concatenate(padded_values)

    def make_mask(self, n: int, return_array: bool = False, window_size: Any = None) -> mx.array:
        """Each row's own keys; with `window_size` (a sliding layer), its last ones only,
        as a growing cache's causal window mask for one row is."""
        if n != 1:
            raise ValueError(f"DecodeLayer attends one decode row per sequence, not {n}")
        keys, lengths = mx.arange(self.longest)[None, :], mx.array(self.lengths)[:, None]
        seen = keys < lengths
        if window_size is not None:
            seen = seen & (keys >= lengths - int(window_size))
        return seen[:, None, None, :]
