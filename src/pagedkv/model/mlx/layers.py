"""Each decoder layer's cache on the MLX backend, and what the prefix cache keeps of it.

mlx-lm makes one cache object per layer (`make_prompt_cache`): a `KVCache` for full
attention, a `RotatingKVCache` for a sliding window (it keeps the last `window`
tokens only), an `ArraysCache` for a recurrent layer (a short convolution's last
inputs, a Mamba mixer's SSM state), a `CacheList` for a layer with both (Falcon-H1).
The backend replaces every attention cache, sliding ones included, with a growing
`seq_kv.StoredKVCache` and keeps mlx-lm's `ArraysCache`s as they are:

- A sliding layer then keeps every token, as the torch backend does (`model.hf`),
  and the model's own mask limits what it attends to: mlx-lm's models ask the
  layer's cache for the mask with `window_size` (`create_attention_mask(h, cache,
  window_size=...)`), which a growing cache answers causal within the window. The
  prefix cache stores every block of every layer, and a restore writes only a
  window's rows (`cache.window`), the rest zeros that the mask hides. A model whose
  code never asks for its window's mask (it leaves the dropping to
  `RotatingKVCache`) would attend to every token: the probe records the windows it
  asks for, and such a model keeps mlx-lm's caches, uncached.
- A recurrent layer's arrays are its state after the tokens computed: a snapshot
  is all of them, flattened into one float32 tensor (`StateLayout.numel`), as
  `model.state` does for torch. The prefix cache restores a snapshot beside the
  KV, and the model continues from it; that equals a fresh run only where the
  layer computes a prompt alike whole or cut into chunks, which the probe
  measures (mlx-lm's Mamba-2 scan does not: its chunked parallel form rounds
  otherwise than the state it carries between calls), and refuses caching where not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import torch
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

from pagedkv.errors import ModelNotSupportedError
from pagedkv.model.kinds import LayerKinds
from pagedkv.model.mlx.convert import to_mx, to_torch, torch_dtype
from pagedkv.model.state import StateEntry, StateLayout

PROBE_TOKENS = 8  # cut 3 + 5 to measure a recurrent layer's chunking


class StoredKVCache(KVCache):
    """mlx-lm's `KVCache` holding KV as `storage` (None: as computed) and giving it back
    as `compute`. A sliding layer's too: it grows, and the model's mask keeps the window
    (`layers`)."""

    def __init__(self, storage: mx.Dtype | None) -> None:
        super().__init__()
        self.storage = storage

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        compute = keys.dtype
        storage = compute if self.storage is None else self.storage
        k, v = super().update_and_fetch(keys.astype(storage), values.astype(storage))
        if storage == compute:
            return k, v
        return k.astype(compute), v.astype(compute)

    def adopt(self, keys: mx.array, values: mx.array) -> None:
        """Hold exactly these `[1, kv_heads, tokens, head_dim]` as its first tokens."""
        self.keys, self.values, self.offset = keys, values, int(keys.shape[2])


class _WindowRecorder(StoredKVCache):
    """A growing cache noting every `window_size` the model asks its mask for."""

    def __init__(self, asked: set[int]) -> None:
        super().__init__(None)
        self.asked = asked

    def make_mask(self, *args: Any, window_size: Any = None, **kwargs: Any) -> Any:
        if window_size is not None:
            self.asked.add(int(window_size))
        return super().make_mask(*args, window_size=window_size, **kwargs)


def _parts(cache: Any) -> tuple[Any, ...]:
    return tuple(cache.caches) if isinstance(cache, CacheList) else (cache,)


def substituted(native: list[Any], make_kv: Any) -> list[Any]:
    """mlx-lm's caches with each attention cache (`KVCache`, `RotatingKVCache`, inside
    a `CacheList` too) replaced by `make_kv()`; recurrent caches are fresh copies."""

    def one(cache: Any) -> Any:
        if isinstance(cache, CacheList):
            return CacheList(*(one(c) for c in cache.caches))
        if isinstance(cache, ArraysCache):
            return ArraysCache(len(cache.cache))
        return make_kv()

    return [one(c) for c in native]


def kv_part(cache: Any) -> StoredKVCache:
    """The layer's growing attention cache (inside a `CacheList` too)."""
    for part in _parts(cache):
        if isinstance(part, StoredKVCache):
            return part
    raise ValueError(f"layer cache {type(cache).__name__} holds no StoredKVCache")


def state_parts(cache: Any) -> list[ArraysCache]:
    """The layer's recurrent caches, in order."""
    return [p for p in _parts(cache) if isinstance(p, ArraysCache)]


def _kind(cache: Any) -> tuple[str, int | None, str | None]:
    """A layer's kind, window, and why its cache cannot be substituted (None if it can)."""
    kinds: list[str] = []
    window: int | None = None
    for part in _parts(cache):
        if type(part) is KVCache:
            kinds.append("full")
        elif isinstance(part, RotatingKVCache):
            if part.keep:
                return "sliding", int(part.max_size), f"RotatingKVCache keeping {part.keep}"
            kinds.append("sliding")
            window = int(part.max_size)
        elif type(part) is ArraysCache:
            kinds.append("state")
        else:
            return "none", None, f"mlx-lm cache {type(part).__name__}"
    if not kinds or len(kinds) > 2 or (len(kinds) == 2 and kinds[0] != "state"):
        return "none", None, f"CacheList of {', '.join(type(p).__name__ for p in _parts(cache))}"
    return "+".join(kinds), window, None


@dataclass(frozen=True, slots=True)
class Probe:
    """What `probe` found: the layers, the state layout, a step's keys and vocab."""

    kinds: LayerKinds
    state_layout: StateLayout | None
    keys: mx.array | None  # the first KV layer's keys after the probe
    vocab_size: int
    stored: bool  # every layer's cache substitutes (`substituted`)


def probe(model: Any) -> Probe:
    """Read every layer's kind from the caches mlx-lm makes, run `PROBE_TOKENS` tokens
    through substituted caches, and check what caching needs (module docstring)."""
    native = make_prompt_cache(model)
    found = [_kind(c) for c in native]
    kinds = tuple(k for k, _, _ in found)
    windows = tuple(w for _, w, _ in found)
    problems = [f"layer {i}: {why}" for i, (_, _, why) in enumerate(found) if why]
    ids = mx.array([list(range(PROBE_TOKENS))])
    asked: set[int] = set()
    logits: mx.array | None = None
    caches, stored = native, False
    if not problems:
        try:
            caches, stored = substituted(native, lambda: _WindowRecorder(asked)), True
            logits = model(ids, cache=caches)[:, -1]
            mx.eval(logits, [c.state for c in caches])
        except Exception as exc:  # model code that needs mlx-lm's own cache classes
            problems.append(f"its code fails over growing caches ({type(exc).__name__}: {exc})")
            caches, stored = make_prompt_cache(model), False
    if logits is None:  # mlx-lm's own caches; nothing is substituted
        logits = model(ids, cache=caches)[:, -1]
        mx.eval(logits, [c.state for c in caches])
    for window in sorted({w for w in windows if w is not None} - asked if stored else ()):
        problems.append(
            f"its sliding window of {window} (RotatingKVCache) is not asked of the cache's "
            "mask by mlx-lm's model code, so a growing cache would attend past it"
        )
    layers = LayerKinds(kinds, windows)
    layout = None
    if stored:
        try:
            layout = _state_layout(caches, layers.state_layers)
        except (ValueError, TypeError) as exc:  # an empty slot, a non-float state
            problems.append(f"its recurrent state cannot be snapshotted ({exc})")
    if stored and layout is not None and not problems:
        problems += _chunking_problems(model, native, logits, caches, layers.state_layers)
    keys = None
    if layers.kv_layers:
        parts = _parts(caches[layers.kv_layers[0]])
        keys = next((p.keys for p in parts if getattr(p, "keys", None) is not None), None)
        if keys is None:
            raise ModelNotSupportedError(
                f"found no attention keys in layer {layers.kv_layers[0]}'s mlx-lm cache "
                f"({', '.join(type(p).__name__ for p in parts)}); use --backend torch"
            )
    unsupported = None
    if problems:
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        unsupported = (
            f"the MLX backend cannot cache this model's layers ({shown}); use --backend "
            "torch to cache it"
        )
    unbatched = None
    if unsupported is not None:
        unbatched = "its mlx-lm caches are not all ones the backend substitutes"
    elif layers.state_layers:
        unbatched = "its recurrent layers (mlx-lm ArraysCache) run one sequence per call"
    return Probe(
        LayerKinds(kinds, windows, unsupported, unbatched),
        layout if unsupported is None else None,
        keys,
        int(logits.shape[-1]),
        stored and unsupported is None,
    )


def _state_layout(caches: list[Any], state_layers: tuple[int, ...]) -> StateLayout | None:
    entries: list[StateEntry] = []
    for layer in state_layers:
        for part, cache in enumerate(state_parts(caches[layer])):
            for index, array in enumerate(cache.cache):
                if array is None:
                    raise ValueError(f"layer {layer}'s ArraysCache slot {index} is empty")
                if array.dtype not in _MX_OF.values():
                    raise TypeError(f"layer {layer}'s ArraysCache slot {index} is {array.dtype}")
                field = f"part{part}"
                entries.append(
                    StateEntry(layer, field, index, tuple(array.shape), torch_dtype(array.dtype))
                )
    return StateLayout(tuple(entries)) if entries else None


def _chunking_problems(
    model: Any, native: list[Any], whole: mx.array, caches: list[Any], state_layers: tuple[int, ...]
) -> list[str]:
    """Where the probe's prompt cut 3 + 5 ends in other bits than whole."""
    cut = substituted(native, lambda: StoredKVCache(None))
    model(mx.array([list(range(3))]), cache=cut)
    last = model(mx.array([list(range(3, PROBE_TOKENS))]), cache=cut)[:, -1]
    mx.eval(last, [c.state for c in cut])
    problems = []
    for layer in state_layers:
        for a, b in zip(state_parts(caches[layer]), state_parts(cut[layer]), strict=True):
            pairs = zip(a.cache, b.cache, strict=True)
            if not all(_same(x, y) for x, y in pairs):
                problems.append(
                    f"layer {layer}: its recurrent state (ArraysCache) after a prompt cut into "
                    "chunks differs from the whole prompt's, so a restored snapshot would not "
                    "continue as a fresh run does"
                )
                break
    if not problems and not bool(mx.array_equal(last, whole).item()):
        problems.append("a prompt cut into chunks gives other logits than whole")
    return problems


def _same(x: Any, y: Any) -> bool:
    if x is None or y is None:
        return x is y
    return bool(mx.array_equal(x, y).item())


def snapshot(caches: list[Any], layout: StateLayout) -> torch.Tensor:
    """Every recurrent array, in `layout`'s order, as one float32 tensor."""
    parts: list[torch.Tensor] = []
    for e in layout.entries:
        array = state_parts(caches[e.layer])[int(e.field.removeprefix("part"))].cache[e.index]
        if array is None or tuple(array.shape) != e.shape:
            shape = None if array is None else tuple(array.shape)
            raise RuntimeError(
                f"layer {e.layer} state {e.field}[{e.index}] is {shape}, not {e.shape}"
            )
        parts.append(to_torch(array.astype(mx.float32)).reshape(-1))
    return torch.cat(parts)


def load(caches: list[Any], layout: StateLayout, flat: torch.Tensor) -> None:
    """Put a snapshot back into fresh caches' recurrent layers."""
    if flat.numel() < layout.numel:
        raise ValueError(f"a snapshot of {flat.numel()} values, the model needs {layout.numel}")
    values = to_mx(flat[: layout.numel].to(torch.float32))
    at = 0
    for e in layout.entries:
        target = state_parts(caches[e.layer])[int(e.field.removeprefix("part"))]
        array = values[at : at + e.numel].reshape(e.shape)
        target[e.index] = array.astype(_MX_OF[e.dtype])
        at += e.numel
    mx.eval([c.state for c in caches])


_MX_OF = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
