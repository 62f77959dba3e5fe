"""The seam between the engine and a model backend: what the model computes.

The engine's worker talks to a model only through these two protocols, so a
backend (transformers on torch, `model.hf`; mlx-lm on MLX, `model.mlx`) is one
`Backend` plus one `SeqKV`. What the scheduler decides (queues, the KV budget)
and what the cache records (blocks, tiers, through `cache.prefix.RequestCache`)
stay above this line and never see a backend's types.

The contract:
- KV crosses the seam in one format for every backend: `[L, 2, kv_heads, tokens,
  row_width]` torch tensors of `kv_format.storage_dtype` on `device` (the CPU but
  for torch on CUDA; L: the KV layers, `num_kv_layers`), the shape and dtype the
  pool and every tier store. A
  backend that keeps its KV elsewhere (MLX arrays) converts at the seam: when a
  cached prefix is restored and when a sequence's KV is cached.
- A sequence's KV is a `SeqKV` the backend made (`new_kv`); the worker never
  looks inside it. It holds room for `capacity` tokens; the worker decides
  when it grows (`grown`) and how many of its tokens are computed. Any `SeqKV`
  can be restored into again: whatever it still holds, `restore_target` then
  `set_restored` start it afresh. Where `reuses_kv` (a preallocated buffer whose
  pages cost their first touch: torch's ragged batch), the worker keeps a
  finished sequence's `SeqKV` (a spare, `engine.spares`) and gives it to the
  next sequence of about its size, and moves a growing or forked sequence into
  one; elsewhere (MLX arrays, a transformers cache) it frees it, and growth and
  forks are the backend's own `grown` and `copy`.
- A sequence's life at the seam: `new_kv` (or a spare); with caching on,
  `restore_target` once, then `set_restored` (0 tokens on a miss); then
  `forward_step`s; `kv_of` to cache what it computed; `grown` before it
  outgrows `capacity`; `copy` for each other sample of an `n` > 1 request;
  `snapshot` after a forward where a recurrent snapshot is due.
- `forward_step` computes every chunk of one step (`model.batch.SeqChunk`, whose
  `kv` is the `SeqKV` the backend made) and writes each chunk's new KV into it;
  it returns the float32 logits of the chunks that want them, in
  chunk order. A backend with `batched` False is given one chunk per call (the
  worker isolates a failure to that sequence, and takes a recurrent model's
  snapshots between calls). The worker pads a step's rows with the backend's own
  `stable_rows` (a step holding prompt rows always, every step when
  deterministic); a backend whose products round alike at every row count
  returns None.
- A recurrent model's state (`state_layout`) crosses as one float32 tensor
  (`SeqKV.snapshot`, `SeqKV.set_restored`).
- Identity: `fingerprint` names everything that decides the KV computed for
  given token ids, the backend and its kernels included, so KV computed by
  different backends or kernels never mixes in a tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from pagedkv.model.batch import SeqChunk
    from pagedkv.model.generation_defaults import SamplingDefaults
    from pagedkv.model.kinds import LayerKinds
    from pagedkv.model.kv_format import KVFormat
    from pagedkv.model.state import StateLayout


class SeqKV(Protocol):
    """One sequence's KV (and recurrent state), owned by the backend that made it."""

    @property
    def capacity(self) -> int:
        """Tokens of KV it has room for."""
        ...

    def restore_target(self) -> torch.Tensor:
        """Where a cached prefix is written before the sequence's first forward:
        `[L, 2, kv_heads, capacity, row_width]` of the seam's format, zero-filled
        where nothing was written (a sliding layer's restore writes only its window).
        A backend that computes from other memory copies it in `set_restored`."""
        ...

    def set_restored(self, num_tokens: int, state: torch.Tensor | None) -> None:
        """The first `num_tokens` of `restore_target` hold a cached prefix; `state`: the
        recurrent state after them (models with `state_layout` only), else None."""
        ...

    def kv_of(self, start: int, end: int) -> torch.Tensor:
        """KV of tokens `[start, end)`, `[L, 2, kv_heads, end - start, row_width]` in
        the seam's format (a view where the backend can give one)."""
        ...

    def grown(self, capacity: int, num_tokens: int) -> SeqKV:
        """Room for `capacity` tokens, keeping the first `num_tokens` (may be self)."""
        ...

    def copy(self, num_tokens: int, capacity: int) -> SeqKV:
        """A new sequence's KV holding a copy of the first `num_tokens` (a fork)."""
        ...

    def snapshot(self) -> torch.Tensor:
        """The recurrent state after the computed tokens, float32 `[state_layout.numel]`."""
        ...


class Backend(Protocol):
    """A loaded model, its tokenizer and its KV plumbing; one worker thread owns it."""

    name: str
    backend_name: str  # "torch" | "mlx": what `--backend` chose
    tokenizer: Any
    device: torch.device  # where the seam's tensors live (see the module docstring)
    dtype: Any  # the compute dtype; `str()` names it (stats, the namespace's description)
    max_token_chars: int | None
    max_context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    sampling_defaults: SamplingDefaults
    kinds: LayerKinds
    num_kv_layers: int
    num_kv_heads: int
    kv_windows: tuple[int | None, ...]
    kv_format: KVFormat
    state_layout: StateLayout | None
    prefix_caching_supported: bool
    unsupported_reason: str | None  # why prefix caching is off, if it is
    batched: bool
    # A freed `SeqKV` is worth keeping for the next sequence (a spare): its memory is a
    # preallocated buffer whose pages cost their first touch, and a restore writes into it
    # in place. False where a new one costs no more than a copy into an old one (MLX).
    reuses_kv: bool
    unbatched_reason: str | None  # why `forward_step` takes one chunk at a time, if it does
    deterministic_reason: str | None  # why the deterministic option is refused, if it is
    # The features this backend refuses whatever the model, by name, with why; GET
    # /v1/cache/stats lists them (`runtime.refused`). Empty: it has every feature.
    refused_features: dict[str, str]
    # How decode rows are computed, for `/v1/cache/stats` (`runtime.decode`): "eager", a
    # compiled step (`compile_decode`) with its signature, or why it is not compiled.
    decode_path: str
    vision: Any  # a VLM's image side (`model.vision.VisionModel`), or None
    lora_layers: Any  # `model.lora_layers.LoraLayers`, or None where adapters are refused

    @property
    def kv_bytes_per_token(self) -> int: ...

    def set_kv_dtype(self, name: str) -> None: ...

    def identity(self, block_size: int, deterministic: bool = False) -> dict[str, str]: ...

    def fingerprint(self, block_size: int, deterministic: bool = False) -> str: ...

    def new_kv(self, capacity: int) -> SeqKV: ...

    def forward_step(
        self,
        chunks: list[SeqChunk],
        pad_rows: Callable[[int], int] | None = None,
        group_decode: bool = True,
    ) -> torch.Tensor: ...

    def warmup(self) -> None: ...

    def compile_decode(self) -> None:
        """Compile the decode step before the first request (`CacheConfig.compile_decode`),
        or stay eager and say why in `decode_path`; raises `ModelNotSupportedError` where
        the backend has no compiled step at all."""
        ...

    def close(self) -> None:
        """Free what the backend holds, on the thread that computed with it, after the
        last step: nothing is called after it."""
        ...

    def stable_rows(self) -> Callable[[int], int] | None:
        """The row counts a prompt step is padded to (`model.batch.DeterministicRows`),
        or None where the backend's products round alike at every row count."""
        ...

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]: ...

    def check_length(self, text: str, max_tokens: int | None) -> None: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]: ...
