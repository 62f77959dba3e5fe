"""Which part of a cached prefix each layer needs: all of it, or its last window.

A sliding-window layer with window W attends, from position p, to keys
(p - W, p]. A sequence resuming after a restored prefix of n tokens first
computes position n, so a sliding layer needs keys [n - W + 1, n) of the
prefix and never any before. The restore copies, for such a layer, from the
start of the block holding n - W + 1 (at most one block more than the window),
and leaves the earlier positions of its buffer as they were: zeros, which
attention masks out (finite numbers masked out contribute exactly nothing, so
the output is bit-identical to one computed with the real keys there).

Blocks still store every layer's KV for all their tokens: any block lies inside
the window of some later restore point, so a sliding layer's old KV cannot be
dropped when it is stored, only skipped when it is restored. Rejected: storing
only the window at each block boundary, which would store W tokens per block
instead of one block's worth.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.cache.ram import RamBlockStore


@dataclass(frozen=True, slots=True)
class LayerRun:
    """Consecutive KV layers `[first, last)` of one kind (`windowed`: sliding) that all
    need the prefix from block `first_block` on. `part_first`: the run's first row in
    the stored part that holds its kind's layers (`cache.split`)."""

    first: int
    last: int
    first_block: int
    windowed: bool = False
    part_first: int = 0

    @property
    def layers(self) -> slice:
        return slice(self.first, self.last)

    @property
    def part_rows(self) -> slice:
        return slice(self.part_first, self.part_first + self.last - self.first)


def window_runs(
    windows: Sequence[int | None], num_layers: int, num_tokens: int, block_size: int
) -> list[LayerRun]:
    """The layers of a restore of `num_tokens` tokens, grouped into runs of one kind
    that start at the same block. `windows` empty: every layer is full, one run."""
    if not windows:
        return [LayerRun(0, num_layers, 0)]
    runs: list[LayerRun] = []
    seen = {False: 0, True: 0}  # layers of each kind before this one
    for i, window in enumerate(windows):
        windowed = window is not None
        first = 0 if window is None else max(0, num_tokens - window + 1) // block_size
        last = runs[-1] if runs else None
        if last and last.first_block == first and last.windowed == windowed and last.last == i:
            runs[-1] = LayerRun(last.first, i + 1, first, windowed, last.part_first)
        else:
            runs.append(LayerRun(i, i + 1, first, windowed, seen[windowed]))
        seen[windowed] += 1
    return runs


def restored_bytes(
    windows: Sequence[int | None], num_tokens: int, block_size: int, bytes_per_layer_token: int
) -> int:
    """Bytes a restore of `num_tokens` copies into a sequence's buffers."""
    total = 0
    for run in window_runs(windows, max(1, len(windows)), num_tokens, block_size):
        total += (run.last - run.first) * (num_tokens - run.first_block * block_size)
    return total * bytes_per_layer_token


def copy_prefix(
    ram: RamBlockStore,
    ram_ids: Sequence[int],
    ram_tokens: int,
    pieces: Sequence[torch.Tensor],
    window_pieces: Sequence[torch.Tensor | None] | None,
    first_piece_block: int,
    out: torch.Tensor,
    n: int,
    placed: int = 0,
) -> None:
    """Write tokens `[0, n)` of a prefix into `out` `[L, 2, H, >= n, D]`: `[0,
    ram_tokens)` from the RAM blocks `ram_ids`, the rest from `pieces` (lower-tier
    blocks' KV, the first of them block `first_piece_block`); each sliding layer from
    its window's first block on. With `window_pieces` (`cache.split`) `pieces` hold
    the full layers only and `window_pieces` the sliding layers, None outside the
    window. `pieces[:placed]` are in `out` already, for every layer (a restore
    without sliding layers copies each block as its read completes). One gather per
    run of layers, never per token."""
    bs = ram.layout.block_size
    for run in window_runs(ram.layout.windows, out.shape[0], n, bs):
        rows, start = out[run.layers], run.first_block * bs
        if start and out.device.type != "cpu":
            rows[:, :, :, :start].zero_()  # CPU buffers are fresh zero pages already
        if start < ram_tokens:
            ram.gather_into(ram_ids[run.first_block :], rows[:, :, :, start:ram_tokens], run.layers)
        lo = max(start, ram_tokens, (first_piece_block + placed) * bs if placed else 0)
        if lo >= n:
            continue
        source: Sequence[torch.Tensor | None] = pieces
        part = run.layers
        if window_pieces is not None:
            source = window_pieces if run.windowed else pieces
            part = run.part_rows
        left, taken = n - lo, []
        for kv in source[lo // bs - first_piece_block :]:
            assert kv is not None, "a window part the restore did not fetch"
            take = min(kv.shape[3], left)
            taken.append(kv[part, :, :, :take])
            left -= take
            if not left:
                break
        torch.cat(taken, dim=3, out=rows[:, :, :, lo:n])
