"""How KV is held: the dtype of the live buffers, the RAM slabs and every tier.

The model computes keys and values in its own dtype; a `KVFormat` says how
they are stored. Storage happens once, when attention writes a token's KV into
its sequence's buffer, and attention then reads the stored values back (upcast)
for every query, the chunk just computed included. So a fresh prefill and a
restored prefix attend over the same numbers, and the tiers hold those numbers
bit for bit: a restore copies bytes, it never converts. Rejected: compressing
only what goes to the tiers, which makes a cached answer differ from a fresh one.

Formats:
- `auto`: the model's dtype, today's behaviour.
- `bfloat16`, `float16`: a plain cast (round to nearest even).
- `int8`: 8-bit values with one float32 scale per token, per head, per K or V
  row (absmax / 127). A row is stored as
  uint8 bytes `[values (head_dim, padded to 4) | scale (4 bytes)]`, so a block is
  still one tensor `[L, 2, H, tokens, row_bytes]` everywhere below the model.
  The scale is fixed when the token is written and depends on that row alone:
  a per-block scale was rejected because it changes while the block fills, so
  a token's stored value would depend on which tokens followed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.config import KV_DTYPES

_PLAIN = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Largest magnitude each 8-bit element holds.
# float8_e4m3fn with the same per-row scale was measured and rejected: on the
# bundled model's KV shapes its relative error is 4x int8's (0.025 against 0.006)
# and reading it back 3x slower on these CPUs (no native e4m3 conversion).
_EIGHT_BIT = {"int8": (torch.int8, 127.0)}
_SCALE_BYTES = 4


@dataclass(frozen=True, slots=True)
class KVFormat:
    """One way to hold a model's KV rows of `head_dim` values.

    `storage_dtype` and `row_width` are what the buffers, slabs and tiers see: a
    stored row is `row_width` elements of `storage_dtype`. `name` is what the
    namespace records: blocks of different formats never mix.
    """

    name: str
    head_dim: int
    storage_dtype: torch.dtype
    row_width: int
    _element: torch.dtype | None = None  # the 8-bit element type; None: a plain cast
    _max: float = 0.0

    @property
    def scaled(self) -> bool:
        return self._element is not None

    @property
    def bytes_per_row(self) -> int:
        return self.row_width * torch.empty((), dtype=self.storage_dtype).element_size()

    def write(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Store rows `x` `[..., head_dim]` into `out` `[..., row_width]` (same leading
        shape, may be a strided view of a buffer)."""
        if self._element is None:
            out.copy_(x)
            return
        x = x.float()
        amax = x.abs().amax(dim=-1, keepdim=True)
        # A zero row gets scale 1 (all values 0) rather than 0/0.
        scale = torch.where(amax > 0, amax / self._max, torch.ones_like(amax))
        q = x / scale
        if self._element is torch.int8:
            q = q.round_().clamp_(-127, 127)
        out[..., : self.head_dim].view(self._element).copy_(q)
        out[..., self.row_width - _SCALE_BYTES :].view(torch.float32).copy_(scale)
        # bytes between the values and the scale (head_dim not a multiple of 4) stay 0
        if self.row_width - _SCALE_BYTES > self.head_dim:
            out[..., self.head_dim : self.row_width - _SCALE_BYTES].zero_()

    def read(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows `[..., row_width]` as values `[..., head_dim]` in `dtype`; the
        stored tensor itself when it already is that (no copy)."""
        if self._element is None:
            return stored if stored.dtype == dtype else stored.to(dtype)
        values = stored[..., : self.head_dim].view(self._element).to(torch.float32)
        scale = stored[..., self.row_width - _SCALE_BYTES :].view(torch.float32)
        return (values * scale).to(dtype)


def kv_format(name: str, model_dtype: torch.dtype, head_dim: int) -> KVFormat:
    """The format `name` (one of `KV_DTYPES`) for a model of `model_dtype`. A plain
    format equal to the model's dtype is `auto`: the same bytes, the same namespace."""
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}; got {name!r}")
    if name in _EIGHT_BIT:
        element, top = _EIGHT_BIT[name]
        values = -(-head_dim // _SCALE_BYTES) * _SCALE_BYTES  # the scale stays 4-aligned
        return KVFormat(name, head_dim, torch.uint8, values + _SCALE_BYTES, element, top)
    dtype = model_dtype if name == "auto" else _PLAIN[name]
    if dtype == model_dtype:
        name = "auto"
    return KVFormat(name, head_dim, dtype, head_dim)
