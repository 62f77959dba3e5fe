"""Recurrent-state snapshots: the fixed-size state of a model's recurrent layers, as
one flat tensor the prefix cache can keep beside a block, and back.

A recurrent layer (LFM2's short convolution, Qwen3-Next's gated delta rule, a
Mamba-2 mixer) keeps no per-token KV: after token t it holds a state of fixed
size that summarises tokens [0, t]. The prefix cache keeps that state at block
boundaries (`snapshot`), and a hit restores it into a fresh transformers cache
(`load`) beside the attention layers' KV, so the model resumes exactly where the
snapshot was taken. transformers keeps these states in `LinearAttentionLayer`s,
`conv_states[i]` and `recurrent_states[i]` (up to `number_of_states` of each).

A snapshot is float32 whatever the model's dtype: a bfloat16 state widens and
narrows back exactly, and a float32 state (Mamba keeps its SSM state in float32
under bfloat16 weights) would lose bits in the model's dtype. Rejected: one
stored tensor per state, which would make every tier's format know shapes that
differ per layer and per architecture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DummyLayer, LinearAttentionLayer

from pagedkv.model.kinds import LayerKinds
from pagedkv.model.kv_layer import GrowableLayer


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One state tensor: `conv_states[index]` or `recurrent_states[index]` of `layer`."""

    layer: int
    field: str  # "conv" | "recurrent"
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """Every state tensor of a model's recurrent layers, in snapshot order."""

    entries: tuple[StateEntry, ...]

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def nbytes(self) -> int:
        """Bytes of one snapshot (float32)."""
        return 4 * self.numel

    def snapshot(self, cache: Any) -> torch.Tensor:
        """A float32 copy of the cache's recurrent states, `[numel]`."""
        parts = []
        for e in self.entries:
            layer = cache.layers[e.layer]
            states = layer.conv_states if e.field == "conv" else layer.recurrent_states
            t = states[e.index]
            if t is None or tuple(t.shape) != e.shape:
                raise RuntimeError(
                    f"layer {e.layer} {e.field} state {e.index} is "
                    f"{None if t is None else tuple(t.shape)}, expected {e.shape}"
                )
            parts.append(t.detach().reshape(-1).to(torch.float32))
        return torch.cat(parts)

    def load(self, cache: Any, flat: torch.Tensor, device: torch.device) -> None:
        """Put a snapshot back into a fresh cache's recurrent layers: the next forward
        continues from it, as if every token before it had just been computed."""
        if flat.numel() < self.numel:
            raise ValueError(f"a snapshot of {flat.numel()} values, the model needs {self.numel}")
        at = 0
        for e in self.entries:
            layer = cache.layers[e.layer]
            value = flat[at : at + e.numel].view(e.shape).to(device=device, dtype=e.dtype)
            at += e.numel
            if e.field == "conv":
                layer.lazy_initialization(
                    conv_states=value, state_idx=e.index, conv_kernel_size=e.shape[-1]
                )
                layer.conv_states[e.index].copy_(value)
                layer.has_previous_state[e.index] = True
            else:
                layer.lazy_initialization(recurrent_states=value, state_idx=e.index)
                layer.recurrent_states[e.index].copy_(value)


def probe_state_layout(adapter: Any, state_layers: Sequence[int]) -> StateLayout:
    """Run two tokens through a fresh cache and read the shape of every state the
    recurrent layers keep (they are created lazily, by the first forward)."""
    cache = adapter.new_cache()
    adapter.forward([1, 2], cache)
    entries = []
    for i in state_layers:
        layer = cache.layers[i]
        for field, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            for index in range(layer.number_of_states):
                t = states.get(index)
                if t is not None:
                    entries.append(StateEntry(i, field, index, tuple(t.shape), t.dtype))
    return StateLayout(tuple(entries))


def cache_layer_problem(layers: Sequence[Any], kinds: LayerKinds) -> str | None:
    """Why the cache layers transformers builds for the model differ from what the
    config says its layers are (None when they agree): the model's actual cache
    classes decide, so an architecture with a cache of its own is caught here even
    when its config reads like plain attention."""
    want = {"full": GrowableLayer, "sliding": GrowableLayer, "state": LinearAttentionLayer,
            "none": DummyLayer}  # fmt: skip
    if len(layers) != len(kinds.kinds):
        return f"transformers builds {len(layers)} cache layers for {len(kinds.kinds)} layers"
    for i, (layer, kind) in enumerate(zip(layers, kinds.kinds, strict=True)):
        if kind.startswith("state+"):
            return (
                f"layer {i} keeps attention KV and a recurrent state in one cache layer "
                f"({type(layer).__name__}, kind {kind}), which pagedkv cannot restore yet"
            )
        if type(layer) is not want.get(kind):
            return (
                f"layer {i} ({kind}) keeps its cache in {type(layer).__name__}, a cache layer "
                "type pagedkv cannot cut into reusable blocks"
            )
    return None
