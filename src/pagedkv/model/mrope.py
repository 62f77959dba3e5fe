"""Multimodal rotary positions (M-RoPE, Qwen2-VL): three position rows (temporal,
height, width) per token, where an image's tokens take their place in the image's grid.

A text token's three rows are equal. An image of `t x h x w` tokens (after the
encoder's spatial merge) starting at token index `s`, whose text position there is
`p = s + delta`, gives its token `r` the rows `(p + r // (h * w), p + (r // w) % h,
p + r % w)`; the text after it continues from `p + max(h, w)`, not from its token
index: each image moves every later position by `max(h, w) - t * h * w` (the model's
own `get_rope_index`, whose temporal row is 0 for an image, `t` being 1). So a token's
positions follow from its index and the grids of the images before it alone, and a
decode step at index `i` is at `i + delta` (the sum over all the prompt's images, the
model's `rope_deltas`): `MRopePositions`, made once per request from its images and
kept with it, gives both, whether the prompt was computed, restored from the cache,
preempted and resumed or forked for `n > 1`.

The grids depend on the image's size and the processor's settings, which the image's
key already names, and every block from the image on chains through that key: KV at
positions moved by one image is never reused for another (`model.vision`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedkv.model.vision import ImageSpan


@dataclass(frozen=True, slots=True)
class MRopePositions:
    """A prompt's images as positions see them: `(start, t, h, w)` per image, in order,
    `t * h * w` tokens each; `delta`: what every token after the last image adds to
    its index (the model's `rope_deltas`)."""

    grids: tuple[tuple[int, int, int, int], ...]
    delta: int

    def after_images(self, start: int) -> bool:
        """Whether token index `start` comes after every image (its three positions are
        then `start + delta`: every decode step)."""
        s, t, h, w = self.grids[-1]
        return start >= s + t * h * w

    def rows(self, start: int, n: int) -> torch.Tensor:
        """The positions `[3, n]` of token indices `[start, start + n)`."""
        index = torch.arange(start, start + n)
        if self.after_images(start):
            return (index + self.delta).expand(3, n)
        out = index.repeat(3, 1)
        delta = 0
        for s, t, h, w in self.grids:
            e = s + t * h * w
            if s >= start + n:
                break
            inside = (index >= s) & (index < e)
            if bool(inside.any()):
                r = index[inside] - s
                p = s + delta
                out[0, inside] = p + r // (h * w)
                out[1, inside] = p + (r // w) % h
                out[2, inside] = p + r % w
            shift = max(h, w) - t * h * w
            out[:, index >= e] += shift
            delta += shift
        return out


def mrope_positions(images: Sequence[ImageSpan]) -> MRopePositions | None:
    """The M-RoPE positions of a prompt with these images; None when they take plain
    1-D positions (no image has a position grid)."""
    grids = []
    delta = 0
    for span in images:
        if span.rope_grid is None:
            return None
        t, h, w = span.rope_grid
        grids.append((span.start, t, h, w))
        delta += max(h, w) - t * h * w
    if not grids:
        return None
    return MRopePositions(tuple(grids), delta)


def mrope_rows(chunks: Sequence[tuple[MRopePositions | None, int, int]], rows: int) -> torch.Tensor:
    """Position ids `[3, 1, rows]` of a batch's chunks `(positions, start, n)`: each
    chunk's M-RoPE rows, or its plain positions in all three (None); padding rows at 0.
    Built as lists, a decode step's rows being its index plus the offset: for 8 decode
    rows `plan_batch` took 61-82 us, against 334 us with a tensor per chunk and 40-47
    us with plain `[1, rows]` positions (loaded 2-core machine, /tmp bench of
    `plan_batch` alone)."""
    out: list[list[int]] = [[], [], []]
    for pos, start, n in chunks:
        if pos is not None and not pos.after_images(start):
            for row, values in zip(out, pos.rows(start, n).tolist(), strict=True):
                row.extend(values)
            continue
        first = start + (pos.delta if pos is not None else 0)
        for row in out:
            row.extend(range(first, first + n))
    for row in out:
        row.extend([0] * (rows - len(row)))
    return torch.tensor(out, dtype=torch.long).unsqueeze(1)
