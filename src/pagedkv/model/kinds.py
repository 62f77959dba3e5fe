"""What a model's layers are, read from its transformers config, never from its name
alone: which can be cut into reusable KV blocks and which the ragged batch can run."""

from __future__ import annotations

from typing import Any

# Architectures whose state is not (only) per-token attention KV.
_RECURRENT_MODEL_TYPES = (
    "mamba", "mamba2", "rwkv", "recurrent_gemma", "jamba", "bamba", "zamba", "zamba2",
    "falcon_h1", "falcon_mamba", "granitemoehybrid", "lfm2", "xlstm", "nemotron_h",
    "qwen3_next", "minimax", "plamo2",
)  # fmt: skip


def prefix_caching_unsupported_reason(config: Any) -> str | None:
    """Why this model's KV cannot be cut into reusable blocks, or None when it can."""
    return classify_layers(config)[0]


def classify_layers(config: Any) -> tuple[str | None, tuple[int, ...]]:
    """(reason prefix caching is impossible or None, layers to cache as full attention).

    Reusable blocks need every layer to keep one K and V per token of the whole
    context: a sliding-window layer drops old tokens, a recurrent layer keeps a
    state instead of per-token KV, and a layer sharing another's KV has none.
    A sliding window at least as long as the context never drops anything (e.g.
    Phi-3-128k), so such layers count as full attention. The layer types come
    from transformers' own dispatch (`get_layer_types_and_kwargs`), so qwen2's
    `use_sliding_window` / `max_window_layers` and mistral's `sliding_window`
    read as transformers reads them.
    """
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if model_type in _RECURRENT_MODEL_TYPES or "mamba" in model_type:
        return f"model type {model_type!r} has recurrent (state-space) layers", ()
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported", ()
    try:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text)
    except Exception as exc:  # an architecture the cache code cannot describe
        return f"cannot read the layer types of model type {model_type!r}: {exc}", ()
    context = getattr(text, "max_position_embeddings", None)
    widened: list[int] = []
    other: list[str] = []
    windows: set[int] = set()
    for i, (kind, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True)):
        if kind == "full_attention":
            continue
        window = kwargs.get("sliding_window")
        if kind in ("sliding_attention", "chunked_attention") and isinstance(window, int):
            if context is not None and window >= context:
                widened.append(i)
                continue
            windows.add(window)
        other.append(kind)
    if other:
        kinds = ", ".join(sorted(set(other)))
        detail = f" (window {', '.join(map(str, sorted(windows)))} tokens)" if windows else ""
        return (
            f"{len(other)} of {len(layer_types)} layers are {kinds}{detail}, which keep no "
            "KV for older tokens; prefix caching needs full attention in every layer"
        ), ()
    return None, tuple(widened)


def ragged_unsupported_reason(config: Any) -> str | None:
    """Why the model's layers cannot run in a ragged batch (`model.batch`), or None.
    Every layer must be attention over per-token KV, full or sliding: a recurrent
    layer keeps a state that a ragged row cannot carry."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    if model_type in _RECURRENT_MODEL_TYPES or "mamba" in model_type:
        return f"model type {model_type!r} has recurrent (state-space) layers"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    try:
        layer_types, _ = get_layer_types_and_kwargs(text)
    except Exception as exc:  # an architecture the cache code cannot describe
        return f"cannot read the layer types of model type {model_type!r}: {exc}"
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        return f"layers of kind {', '.join(other)}"
    return None
