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

    def rows(self, start: int, n: int) -> torch.Tensor:
        """The positions `[3, n]` of token indices `[start, start + n)`."""
        index = torch.arange(start, start + n)
        last = self.grids[-1]
        if start >= last[0] + last[1] * last[2] * last[3]:  # past every image: decode
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
