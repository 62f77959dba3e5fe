"""What a model's layers are, read from its transformers config, never from its name.

Each decoder layer is one of:
- `full`: attention over per-token KV of the whole context;
- `sliding`: attention over the last `window` tokens only (chunked attention reads
  as sliding too: a chunk never reaches further back than its size);
- `state`: a recurrent state of fixed size (LFM2's short convolutions, Qwen3-Next's
  gated delta rule, Mamba-2 mixers), no per-token KV;
- `state+full` / `state+sliding`: both side by side in one layer (Falcon-H1);
- `none`: no cache at all (an MLP/MoE-only layer).

The layer types come from transformers' own dispatch (`get_layer_types_and_kwargs`,
the same table that picks each layer's cache class), so qwen2's `use_sliding_window`
/ `max_window_layers`, mistral's `sliding_window`, LFM2's `layer_types` and Bamba's
`attn_layer_indices` read exactly as transformers reads them. Rejected: a list of
model names, which is wrong for every new hybrid and for configs that turn a
feature off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_STATE_TYPES = {"conv": "state", "linear_attention": "state", "mamba": "state"}
_HYBRID_TYPES = {"hybrid": "state+full", "hybrid_sliding": "state+sliding"}


@dataclass(frozen=True, slots=True)
class LayerKinds:
    """Per decoder layer: its kind and its window (None unless it slides).

    `unsupported` says why prefix caching cannot work for the model (None when it
    can); `unbatched` why the ragged batch cannot run it (None when it can)."""

    kinds: tuple[str, ...]
    windows: tuple[int | None, ...]
    unsupported: str | None = None
    unbatched: str | None = None

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Layers that keep per-token KV, in order: the rows of a KV buffer."""
        return tuple(i for i, k in enumerate(self.kinds) if k.endswith(("full", "sliding")))

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Layers that keep a recurrent state."""
        return tuple(i for i, k in enumerate(self.kinds) if k.startswith("state"))

    @property
    def kv_windows(self) -> tuple[int | None, ...]:
        """The window of each KV layer (None: full attention)."""
        return tuple(self.windows[i] for i in self.kv_layers)

    def describe(self) -> str:
        """`full x2, sliding(16) x4, state x3`, in order of first appearance."""
        counts: dict[str, int] = {}
        for kind, window in zip(self.kinds, self.windows, strict=True):
            name = f"{kind}({window})" if window is not None else kind
            counts[name] = counts.get(name, 0) + 1
        return ", ".join(f"{name} x{n}" for name, n in counts.items())


def read_layer_kinds(config: Any) -> LayerKinds:
    """The kind of every decoder layer of a transformers config (see the module doc)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if getattr(config, "is_encoder_decoder", False):
        reason = "encoder-decoder models are not supported"
        return LayerKinds((), (), reason, reason)
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    except Exception as exc:  # an architecture the cache code cannot describe
        reason = f"cannot read the layer types of model type {model_type!r}: {exc}"
        return LayerKinds((), (), reason, reason)
    context = getattr(text, "max_position_embeddings", None)
    kinds: list[str] = []
    windows: list[int | None] = []
    unknown: list[str] = []
    for kind, kwargs in zip(layer_types, layer_kwargs, strict=True):
        window = kwargs.get("sliding_window")
        window = window if isinstance(window, int) and window > 0 else None
        wide = window is None or (context is not None and window >= context)
        if kind in ("sliding_attention", "chunked_attention", "hybrid_sliding") and wide:
            # A window at least as long as the context never drops a token (Phi-3-128k).
            kind, window = ("hybrid" if kind == "hybrid_sliding" else "full_attention"), None
        if kind == "full_attention":
            kinds.append("full")
        elif kind in ("sliding_attention", "chunked_attention"):
            kinds.append("sliding")
        elif kind in _STATE_TYPES:
            kinds.append(_STATE_TYPES[kind])
            window = None
        elif kind in _HYBRID_TYPES:
            kinds.append(_HYBRID_TYPES[kind])
        elif kind == "dummy" and getattr(text, "kv_sharing_modes", None) is None:
            kinds.append("none")
        else:
            kinds.append(kind)
            unknown.append(kind if kind != "dummy" else "shared-KV (dummy)")
        windows.append(window if kinds[-1].endswith("sliding") else None)
    unsupported = unbatched = None
    if unknown:
        unsupported = (
            f"{len(unknown)} of {len(layer_types)} layers are of cache layer type "
            f"{', '.join(sorted(set(unknown)))}, which pagedkv cannot cut into reusable blocks"
        )
        unbatched = f"layers of kind {', '.join(sorted(set(unknown)))}"
    elif not any(k.endswith(("full", "sliding")) for k in kinds):
        unsupported = "no layer keeps per-token KV (a pure recurrent model)"
    other = sorted({k for k in kinds if k not in ("full", "sliding")})
    if unbatched is None and other:
        unbatched = f"layers of kind {', '.join(other)} keep a state a ragged row cannot carry"
    return LayerKinds(tuple(kinds), tuple(windows), unsupported, unbatched)


def prefix_caching_unsupported_reason(config: Any) -> str | None:
    """Why this model's KV cannot be cut into reusable blocks, or None when it can."""
    return read_layer_kinds(config).unsupported


def ragged_unsupported_reason(config: Any) -> str | None:
    """Why the model's layers cannot run in a ragged batch (`model.batch`), or None.
    Every layer must be attention over per-token KV, full or sliding: a recurrent
    layer keeps a state that a ragged row cannot carry."""
    return read_layer_kinds(config).unbatched
