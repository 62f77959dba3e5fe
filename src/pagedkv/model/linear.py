"""Linear layers that stay fast for the few rows of a decode step.

A decode step over a batch multiplies a handful of rows (one per sequence) by
every weight matrix. On the CPUs this was measured on (AMD EPYC, MKL 2024),
`F.linear` is slow at 2-16 rows: 4-8 rows of the bundled model's output layer
cost 3-4x one row, while the same product written the other way round,
`(W @ x.T).T`, costs 0.6-1.1x one row. Which way wins depends on the BLAS and
the CPU, so `tune_linears` times both ways once per weight shape at start-up
and keeps the flipped product only where it is faster. One row keeps
`F.linear` (its matrix-vector kernel is already bandwidth-bound), and so do
prefill chunks.
"""

from __future__ import annotations

import time
from typing import cast

import torch
import torch.nn.functional as F

# Row counts the flipped product may serve; above this a prefill chunk is running.
MAX_FLIPPED_ROWS = 16
_PROBE_ROWS = 8


class RowLinear(torch.nn.Linear):
    """An `nn.Linear` whose forward takes the flipped product for 2..16 rows when
    `flipped` (set by `tune_linears`). Same parameters, same results up to rounding;
    the rounding of a row then depends on how many rows run with it, so deterministic
    batching turns flipping off (`set_flipping`)."""

    flipped: bool = False
    faster_flipped: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.flipped and 2 <= rows <= MAX_FLIPPED_ROWS:
            # A row-major copy first: the output of another flipped product (and of
            # elementwise ops over it) is column-major, and BLAS takes 2-4x longer
            # over that (down_proj shape, 2 and 8 rows: ~850 vs ~180-420 us).
            y = (self.weight @ x.reshape(rows, x.shape[-1]).contiguous().t()).t()
            if self.bias is not None:
                y = y + self.bias
            return y.reshape(*x.shape[:-1], self.weight.shape[0])
        return F.linear(x, self.weight, self.bias)


def tune_linears(model: torch.nn.Module) -> dict[tuple[int, int], bool]:
    """Make every `nn.Linear` of `model` a `RowLinear`, flipped for the weight shapes
    where the flipped product of `_PROBE_ROWS` rows measured faster. Returns the
    choice per shape `(out_features, in_features)`."""
    choice: dict[tuple[int, int], bool] = {}
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight
        shape = (weight.shape[0], weight.shape[1])
        if shape not in choice:
            choice[shape] = _flipped_is_faster(weight)
        module.__class__ = RowLinear
        row = cast(RowLinear, module)
        row.faster_flipped = row.flipped = choice[shape]
    return choice


def set_flipping(model: torch.nn.Module, on: bool) -> None:
    """Flip where it measured faster (`on`), or never: every row through `F.linear`."""
    for module in model.modules():
        if isinstance(module, RowLinear):
            module.flipped = on and module.faster_flipped


def _flipped_is_faster(weight: torch.Tensor) -> bool:
    x = torch.randn(_PROBE_ROWS, weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        plain = _best_time(lambda: F.linear(x, weight))
        flipped = _best_time(lambda: (weight @ x.t()).t())
    return flipped < 0.9 * plain


def _best_time(fn: object, reps: int = 3) -> float:
    assert callable(fn)
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
