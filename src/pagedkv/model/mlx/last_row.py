"""Logits of a prompt chunk's last row only.

mlx-lm's models compute the output layer over every row they are given; a prompt
chunk needs its last row's logits alone, and on mlx-cpu the output layer's cost
grows with its rows (measured: SmolLM2's 49152 x 576 head took 42 ms for one row
and 306 ms for eight, loaded host), so a 512-token chunk paid hundreds of head rows
for one. mlx-lm has no `logits_to_keep`; the final norm is where the rows can be
cut: it works row by row, and the head after it sees only what the norm returns.

`LastRowNorm` wraps the decoder's final norm (`model.model.norm` in mlx-lm's
Llama, Qwen, Gemma, Phi and most others) and, while `last_only` is set, hands it
the last row only. `install` puts it in place only where a probe shows the cut
model's last row equal, bit for bit, to the whole model's; elsewhere every row is
computed as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache


class LastRowNorm(nn.Module):
    """The final norm, given only the last row of its input while `last_only`."""

    def __init__(self, norm: Any) -> None:
        super().__init__()
        self.norm = norm
        self.last_only = False

    def __call__(self, x: mx.array) -> mx.array:
        return self.norm(x[:, -1:, :] if self.last_only else x)


def install(model: Any) -> LastRowNorm | None:
    """Wrap `model`'s final norm where that keeps the last row's logits exact; the
    wrapper, or None (the model then computes every row's logits)."""
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if inner is None or not isinstance(norm, nn.Module) or isinstance(norm, LastRowNorm):
        return None
    ids = mx.array([[(7 * i + 3) % 64 for i in range(6)]])
    want = model(ids, cache=make_prompt_cache(model))[:, -1]
    wrapper = LastRowNorm(norm)
    inner.norm = wrapper
    try:
        wrapper.last_only = True
        got = model(ids, cache=make_prompt_cache(model))
        exact = got.shape[1] == 1 and bool(mx.array_equal(got[:, -1], want).item())
    except Exception:  # a model whose code uses the norm's rows otherwise
        exact = False
    finally:
        wrapper.last_only = False
    if not exact:
        inner.norm = norm
        return None
    return wrapper


@contextmanager
def last_row_only(wrapper: LastRowNorm | None) -> Iterator[None]:
    """While inside: the model returns the logits of its input's last row only."""
    if wrapper is None:
        yield
        return
    wrapper.last_only = True
    try:
        yield
    finally:
        wrapper.last_only = False
