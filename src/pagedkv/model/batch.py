"""Many sequences in one forward: a ragged batch over per-sequence KV buffers.

The engine's step puts every running sequence's new tokens (one for a decoding
sequence, a chunk for a prefilling one) side by side in one row of
`[1, total_tokens]`, with each token's own position. Everything in a decoder
but attention works token by token, so the linear layers see one matrix of all
the step's tokens: that is where batching pays. Attention is the one place
where sequences must stay apart; `ragged_attention`, registered with
transformers as an attention implementation, writes each sequence's new keys
and values into that sequence's own buffer `[L, 2, kv_heads, capacity,
head_dim]` and attends over it alone.

Rejected: a padded `[batch, max_len]` batch over transformers' cache objects,
which copies (or pads) every sequence's whole history into one tensor at every
step; and attention over the RAM tier's paged blocks, which on CPU means
gathering the blocks into a contiguous run at every step (a copy of the whole
context per token) for want of a paged kernel.

Exactness: a prompt row's attention must come out bit-identical whatever
chunk it arrived in (the whole prompt, a 512-token chunk, or the one-token
suffix after a cached prefix), or a cached answer differs from a fresh one;
in bfloat16 one differing bit grows into another token within a few dozen
(issue 29, item 13). The CPU flash-attention kernel does not give that by
itself: it cuts the keys into blocks of min(512, number of keys) and the
queries into blocks of 32, 64 or 256 rows, and a row's sums change with the
key block's width and when its query block has 1-3 rows (measured: most
(start, length) chunks of a 150-token prompt differ from the whole prompt's
rows, in float32, float16 and bfloat16). So every prompt chunk is attended
in one shape family (`_Span.prompt`): keys passed from a multiple of
`_KEY_ALIGN` (0 for full attention) and padded with zeros to a multiple of
`_KEY_BLOCK`, so every key block is 512 wide and at the same absolute
position; an explicit mask (never `is_causal`, which cuts the last block at
the diagonal); query rows padded to a multiple of `_QUERY_ROWS`, so no query
block has 1-3 rows. Measured: every chunk of 1-200 rows of a 300- and a
1100-token prompt then matches the whole prompt's rows bit for bit, in all
three dtypes. Decode rows keep their faster paths (a request's decode steps
are decode rows whether its prompt was cached or not). The linear layers are
the other half: a row may depend on the number of rows for a few small
counts (one row alone, over the packed layers of `model/linear.py`); a step
that computes prompt rows is padded to a count that rounds like all the
others (`DeterministicRows`, applied by the worker).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface

from pagedkv.model.kv_format import KVFormat
from pagedkv.model.lora import LoraWeights
from pagedkv.model.mrope import mrope_rows

if TYPE_CHECKING:
    from pagedkv.model.mrope import MRopePositions
    from pagedkv.model.vision import ImageSpan

ATTENTION_NAME = "pagedkv_ragged"
# Multiple of the CPU flash-attention kernel's key block (512), so a sliding window's
# first key block starts at the same absolute position however a prefill was chunked.
_KEY_ALIGN = 2048
# The CPU flash-attention kernel's key block; a prompt chunk's keys are padded to a
# multiple of it, so the kernel never takes a narrower block (which sums otherwise).
_KEY_BLOCK = 512
# A prompt chunk's query rows are padded to a multiple of this: the kernel's query
# blocks (32, 64 or 256 rows) then never end in 1-3 rows, which sum otherwise.
_QUERY_ROWS = 4
# Decode rows with at most this many keys each are attended in one call per layer,
# when the padded copy of one layer's keys and values fits in this many bytes (the
# bundled model's 16 rows at 1K keys take 24 MiB; a wide model's copy counts against
# the memory the KV budget leaves to activations).
_GROUP_MAX_KEYS = 1024
_GROUP_MAX_BYTES = 32 * 2**20
_GROUP_PAD_TO = 64


def ragged_kernel_name() -> str:
    """The ragged attention and the constants of its prompt shape family, as the
    namespace names them: changing one changes how stored KV rounds."""
    family = f"key_align={_KEY_ALIGN},key_block={_KEY_BLOCK},query_rows={_QUERY_ROWS}"
    return f"{ATTENTION_NAME}:{family}"


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a batched forward: `token_ids` at positions `start,
    start + 1, ...`, after the `start` tokens whose KV `kv` already holds.
    `want_logits`: the step samples from the logits of the chunk's last token.

    `kv` is the `model.backend.SeqKV` the backend made, at the seam
    (`Backend.forward_step`); the torch ragged batch's lower level
    (`ModelAdapter.forward_batch`, `plan_batch`) takes the buffer itself, `[L, 2,
    kv_heads, capacity, row_width]`."""

    kv: Any
    start: int
    token_ids: Sequence[int]
    want_logits: bool
    # A one-token chunk is a decode step unless `prompt`: the last token of a prompt
    # whose rest was cached must round as it would inside the whole prompt.
    prompt: bool = False
    # The LoRA adapter the chunk's rows go through (`model.lora_layers`); None: the base.
    lora: LoraWeights | None = None
    # The sequence's images (`model.vision`): rows at their placeholder positions read
    # the image's encoder rows instead of the token's embedding.
    images: Sequence[ImageSpan] = ()
    # The sequence's M-RoPE positions (`model.mrope`), for prompt and decode chunks
    # alike; None: positions `start, start + 1, ...`.
    positions: MRopePositions | None = None

    @property
    def is_prompt(self) -> bool:
        return self.prompt or len(self.token_ids) > 1


@dataclass(slots=True)
class _Span:
    """One chunk as attention sees it: rows `[first, first + n)` of the batch, keys
    `[low, end)` of its buffer, and the mask (None: all of them). The views have a
    leading layer axis, so a layer takes its own with one index. A prompt chunk
    (`rows` not None) is attended in the fixed shape family of the module docstring:
    queries `rows` (the chunk's rows, the last repeated up to a multiple of
    `_QUERY_ROWS`), keys padded to `padded_keys`, `mask` `[len(rows), padded_keys]`."""

    first: int
    n: int
    low: int
    mask: torch.Tensor | None
    new: torch.Tensor  # [L, 2, H, n, D]: where the chunk's keys and values go
    keys: torch.Tensor  # [L, 1, H, end - low, D]
    values: torch.Tensor
    rows: torch.Tensor | None = None
    padded_keys: int = 0


@dataclass(slots=True)
class RaggedPlan:
    """Where each chunk's rows are in the flattened batch; handed to every attention
    layer through the model's keyword arguments. The spans (key ranges and masks) are
    worked out once per window size and shared by every layer with that window."""

    chunks: list[SeqChunk]
    offsets: list[int]
    num_rows: int  # rows that belong to chunks; rows past it are padding
    kv_format: KVFormat | None = None  # how the buffers hold KV; None: the model's dtype
    # Attend the step's decode rows in one call (see `_attend_together`); off under
    # deterministic batching, where a row's sums must not depend on the others' lengths.
    group_decode: bool = True
    _spans: dict[int | None, list[_Span]] = field(default_factory=dict)
    _groups: dict[int | None, _DecodeGroup | None] = field(default_factory=dict)

    def spans(self, window: int | None, device: torch.device) -> list[_Span]:
        spans = self._spans.get(window)
        if spans is None:
            spans = [
                _span(chunk, first, window, device, align=True)
                for chunk, first in zip(self.chunks, self.offsets, strict=True)
            ]
            self._spans[window] = spans
        return spans

    def decode_together(
        self, window: int | None, spans: list[_Span], dtype: torch.dtype
    ) -> _DecodeGroup | None:
        """The decode rows to attend in one call, or None when that does not pay: fewer
        than two, or so many keys that the padded copy would cost more than the calls
        it saves (measured break-even near 1K keys a row on the bundled model) or more
        memory than `_GROUP_MAX_BYTES`. The copy is made once per step and every layer
        with this window reuses it; its length is rounded up to `_GROUP_PAD_TO`, so
        the steps of a stream ask the allocator for the same few sizes."""
        if window in self._groups:
            return self._groups[window]
        group = None
        decode = [s for s in spans if s.rows is None and s.mask is None]
        if self.group_decode and len(decode) >= 2:
            lengths = [s.keys.shape[3] for s in decode]
            longest = max(lengths)
            padded = -(-longest // _GROUP_PAD_TO) * _GROUP_PAD_TO
            _, _, kv_heads, _, head_dim = decode[0].keys.shape
            shape = (len(decode), kv_heads, padded, head_dim)
            copy = 2 * shape[0] * padded * kv_heads * head_dim * dtype.itemsize
            if (
                longest <= _GROUP_MAX_KEYS
                and longest * len(decode) <= 2 * sum(lengths)
                and copy <= _GROUP_MAX_BYTES
            ):
                device = decode[0].keys.device
                mask = torch.arange(padded, device=device) < torch.tensor(
                    lengths, device=device
                ).unsqueeze(1)
                rows = torch.tensor([s.first for s in decode], device=device)
                # Zeros: the padding is never written, and masked keys must be finite.
                keys = torch.zeros(shape, dtype=dtype, device=device)
                group = _DecodeGroup(
                    rows, decode, mask[:, None, None, :], keys, torch.zeros_like(keys)
                )
        self._groups[window] = group
        return group


def _span(
    chunk: SeqChunk, first: int, window: int | None, device: torch.device, align: bool
) -> _Span:
    """Queries at positions `start + i` see keys `[0, start + i]`, and with `window` only
    the last `window` of them. `align`: the ragged batch's spans (prompt chunks in the
    fixed shape family); False for a plain forward over a transformers cache."""
    n = len(chunk.token_ids)
    start, end = chunk.start, chunk.start + n
    low = 0
    if window is not None:
        low = max(0, start - window + 1)
        if align:
            low -= low % _KEY_ALIGN
    kv = chunk.kv
    views = (kv[:, :, :, start:end], kv[:, 0:1, :, low:end], kv[:, 1:2, :, low:end])
    if align and chunk.is_prompt:
        padded = -(-(end - low) // _KEY_BLOCK) * _KEY_BLOCK
        num_rows = -(-n // _QUERY_ROWS) * _QUERY_ROWS
        rows = torch.arange(num_rows, device=device).clamp_(max=n - 1)
        pos = (start + rows).unsqueeze(1)
        kpos = torch.arange(low, low + padded, device=device).unsqueeze(0)
        seen = kpos <= pos  # also hides the padding keys, all past the chunk's end
        for image in chunk.images:  # Gemma 3: an image's rows see all of its keys
            if image.bidirectional and image.start < end and start < image.end:
                if image.start < end < image.end:
                    raise ValueError(
                        f"a prompt chunk [{start}, {end}) ends inside the image "
                        f"[{image.start}, {image.end}), whose tokens attend both ways; "
                        "plan chunks with model.vision.whole_image_take"
                    )
                seen |= _inside(pos, image) & _inside(kpos, image)
        if window is not None:
            seen &= kpos > pos - window
        return _Span(first, n, low, seen, *views, rows=first + rows, padded_keys=padded)
    mask: torch.Tensor | None = None
    if n > 1 or (window is not None and start - low >= window):
        pos = torch.arange(start, end, device=device).unsqueeze(1)
        kpos = torch.arange(low, end, device=device).unsqueeze(0)
        mask = kpos <= pos
        if window is not None:
            mask &= kpos > pos - window
    return _Span(first, n, low, mask, *views)


def _inside(positions: torch.Tensor, image: ImageSpan) -> torch.Tensor:
    return (positions >= image.start) & (positions < image.end)


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    pagedkv_plan: RaggedPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for `[1, heads, rows, head_dim]` queries; returns `[1, rows, heads, head_dim]`.

    With a plan, each chunk's keys and values go into its sequence's buffer first.
    Without one (a plain forward over a transformers cache, which has already
    appended `key`/`value`), the queries are the last rows of the keys."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("ragged attention has no logit softcap or attention sinks")
    window = sliding_window if isinstance(sliding_window, int) and sliding_window > 0 else None
    sdpa = torch.nn.functional.scaled_dot_product_attention
    gqa = query.shape[1] != key.shape[1]
    if pagedkv_plan is None:
        n = query.shape[2]
        start = key.shape[2] - n
        chunk = SeqChunk(key.transpose(0, 1).unsqueeze(0), start, range(n), False)
        s = _span(chunk, 0, window, query.device, align=False)
        o = sdpa(query, key[:, :, s.low :], value[:, :, s.low :], attn_mask=s.mask,
                 scale=scaling, enable_gqa=gqa)  # fmt: skip
        return o.transpose(1, 2).contiguous(), None
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    fmt = pagedkv_plan.kv_format
    plain = fmt is None or (not fmt.scaled and fmt.storage_dtype == query.dtype)
    kv_heads, head_dim = key.shape[1], query.shape[3]
    spans = pagedkv_plan.spans(window, query.device)
    out = query.new_zeros((1, query.shape[1], query.shape[2], head_dim))
    together = pagedkv_plan.decode_together(window, spans, query.dtype)
    for s in spans:
        rows = slice(s.first, s.first + s.n)
        new = torch.stack((key[0, :, rows], value[0, :, rows]), out=s.new[layer] if plain else None)
        if not plain:
            # Attention reads back what was stored, the chunk just written included: the
            # fresh path sees the same rounded values a restored prefix brings.
            assert fmt is not None
            fmt.write(s.new[layer], new)
        decode_row = s.rows is None and s.mask is None
        if together is not None and decode_row:
            continue  # attended below, with the other decode rows
        keys, values = s.keys[layer], s.values[layer]
        if not plain:
            assert fmt is not None
            keys, values = fmt.read(keys, query.dtype), fmt.read(values, query.dtype)
        q = query[:, :, rows]
        if s.rows is not None:  # a prompt chunk, in the fixed shape family
            pad = (0, 0, 0, s.padded_keys - keys.shape[2])
            keys = torch.nn.functional.pad(keys, pad)
            values = torch.nn.functional.pad(values, pad)
            o = sdpa(query.index_select(2, s.rows), keys, values, attn_mask=s.mask,
                     scale=scaling, enable_gqa=gqa)[:, :, : s.n]  # fmt: skip
        elif decode_row:
            # A decode row: the query heads sharing a KV head become rows of that head,
            # the same sums as `enable_gqa`, which measured up to 1.5x slower per step
            # (8 sequences at 1K context).
            grouped = q.reshape(1, kv_heads, -1, head_dim)
            o = sdpa(grouped, keys, values, scale=scaling).reshape(q.shape)
        else:
            o = sdpa(q, keys, values, attn_mask=s.mask, scale=scaling, enable_gqa=gqa)
        out[:, :, rows] = o
    if together is not None:
        _attend_together(together, layer, query, out, fmt if not plain else None, scaling)
    return out.transpose(1, 2), None


@dataclass(slots=True)
class _DecodeGroup:
    """Decode rows attended in one call: their rows of the batch, their spans, the
    mask `[B, 1, 1, padded]` that hides each row's padding keys, and the padded
    `[B, kv_heads, padded, head_dim]` keys and values each layer copies its KV into."""

    rows: torch.Tensor
    spans: list[_Span]
    mask: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


def _attend_together(
    group: _DecodeGroup,
    layer: int,
    query: torch.Tensor,
    out: torch.Tensor,
    fmt: KVFormat | None,
    scaling: float | None,
) -> None:
    """One attention call for every decode row of the step: each row's keys and values
    are copied into the group's padded pair. At short context the copy costs less than
    a call per sequence (measured: ~0.16 ms a call on the bundled model, most of it
    fixed cost)."""
    keys, values = group.keys, group.values
    b, kv_heads, _, head_dim = keys.shape
    for i, s in enumerate(group.spans):
        k, v = s.keys[layer][0], s.values[layer][0]
        if fmt is not None:
            k, v = fmt.read(k, query.dtype), fmt.read(v, query.dtype)
        keys[i, :, : k.shape[1]] = k
        values[i, :, : v.shape[1]] = v
    q = query[0].index_select(1, group.rows).transpose(0, 1)  # [B, heads, head_dim]
    grouped = q.reshape(b, kv_heads, -1, head_dim)
    o = torch.nn.functional.scaled_dot_product_attention(
        grouped, keys, values, attn_mask=group.mask, scale=scaling
    )
    out[0].index_copy_(1, group.rows, o.reshape(b, -1, head_dim).transpose(0, 1))


AttentionInterface.register(ATTENTION_NAME, ragged_attention)


def plan_batch(
    chunks: list[SeqChunk],
    pad_rows: Callable[[int], int] | None = None,
    device: Any = "cpu",
    kv_format: KVFormat | None = None,
    group_decode: bool = True,
) -> tuple[RaggedPlan, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan, input ids `[1, rows]`, position ids `[1, rows]` (`[3, 1, rows]` when a
    chunk has M-RoPE positions) and the rows whose logits are wanted, in chunk order.
    `pad_rows(n)` (see `DeterministicRows`) gives how many rows to run for n real ones,
    and how many logit rows for n wanted: padding rows hold token 0 and attend to
    nothing; padding logit rows repeat one.     `group_decode`: see `RaggedPlan`."""
    offsets: list[int] = []
    ids: list[int] = []
    positions: list[int] = []
    keep: list[int] = []
    row = 0
    for chunk in chunks:
        n = len(chunk.token_ids)
        offsets.append(row)
        ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start, chunk.start + n))
        row += n
        if chunk.want_logits:
            keep.append(row - 1)
    if pad_rows is not None:
        pad = pad_rows(row) - row
        ids.extend([0] * pad)
        positions.extend([0] * pad)
        if keep:
            keep.extend([keep[-1]] * (pad_rows(len(keep)) - len(keep)))
    plan = RaggedPlan(chunks, offsets, row, kv_format, group_decode=group_decode)
    ids_t = torch.tensor([ids], dtype=torch.long, device=device)
    if any(c.positions is not None for c in chunks):
        spans = [(c.positions, c.start, len(c.token_ids)) for c in chunks]
        positions_t = mrope_rows(spans, len(ids)).to(device)
    else:
        positions_t = torch.tensor([positions], dtype=torch.long, device=device)
    return plan, ids_t, positions_t, torch.tensor(keep, dtype=torch.long, device=device)


class DeterministicRows:
    """Row counts at which every row of a linear layer comes out as it would among
    any other number of rows, and the padding that reaches one.

    On these CPUs a matrix product's rows are bit-identical whatever the number
    of rows for most counts, but not for a few small ones, where the library
    takes other kernels (measured: over packed oneDNN weights one row alone
    differs in some shapes; through MKL's `F.linear`, 1-3, 5-7 and 9-11 rows
    differ from 4, 8 and 12 or more). A batch padded to a stable count computes
    each sequence's rows as they would be computed in any other stable batch, so
    a request's output no longer depends on what else runs. The stable counts
    are measured here, on the model's own weight shapes, once at start-up;
    counts above `probe_rows` are taken as stable (prefills of hundreds of rows
    are).

    A float layer is probed through a twin of its shape, dtype and kernel whose
    weights are all ones, fed rows of large values that cancel among small ones:
    its sums then change with the order they are added in. The layer itself, fed
    random rows, hides that order in 16-bit dtypes (a sum summed otherwise
    rounds to the same bfloat16 but about once in 30,000 outputs), and measured
    packed bfloat16 rows stable at one row where the bundled model's down-proj
    was not (issue 29, item 13).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], probe_rows: int = 32) -> None:
        self.probe_rows = probe_rows
        stable = set(range(1, probe_rows + 1))
        gen = torch.Generator().manual_seed(0)
        for layer in layers:
            probe, x = _probe(layer, 2 * probe_rows, gen)
            with torch.inference_mode():
                want = probe(x)
                for rows in list(stable):
                    if not torch.equal(probe(x[:rows]), want[:rows]):
                        stable.discard(rows)
        self.stable = sorted(stable)

    def __call__(self, rows: int) -> int:
        """The smallest stable row count >= `rows`."""
        if rows > self.probe_rows:
            return rows
        return next((s for s in self.stable if s >= rows), self.probe_rows + 1)


def _probe(
    layer: torch.nn.Module, rows: int, gen: torch.Generator
) -> tuple[torch.nn.Module, torch.Tensor]:
    """What to probe `layer`'s row counts through, and its `[rows, in]` input: for a
    float or int4 layer, its all-ones twin (see `DeterministicRows`) and rows where
    values of +-2^20 (+-2^40 in float32), which cancel in pairs, sit among small ones;
    for int8 codes (exact integer sums), the layer and random rows."""
    from pagedkv.model.int4 import Int4Linear, int4_ones_like
    from pagedkv.model.linear import PackedLinear, pack_linear

    weight = layer.weight
    assert isinstance(weight, torch.Tensor) and isinstance(layer, torch.nn.Linear)
    twin: torch.nn.Module
    if isinstance(layer, Int4Linear):
        twin, dtype = int4_ones_like(layer), layer.scales_zeros.dtype
    elif not weight.is_floating_point():
        return layer, torch.randn(rows, layer.in_features, generator=gen)
    else:
        dtype = weight.dtype
        twin = torch.nn.Linear(layer.in_features, layer.out_features, bias=False, dtype=dtype)
        torch.nn.init.ones_(twin.weight)
        twin.requires_grad_(False)
        if isinstance(layer, PackedLinear):
            pack_linear(twin)
    x = torch.randn(rows, layer.in_features, generator=gen)
    big = 2.0**40 if dtype == torch.float32 else 2.0**20
    for row in x:
        where = torch.randperm(layer.in_features, generator=gen)[: layer.in_features // 4]
        half = len(where) // 2
        row[where[:half]] = big
        row[where[half : 2 * half]] = -big
    return twin, x.to(dtype)


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """One linear layer of each distinct weight shape in the model."""
    seen: dict[tuple[int, ...], torch.nn.Module] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            seen.setdefault(tuple(module.weight.shape), module)
    return list(seen.values())
