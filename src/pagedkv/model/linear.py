"""Linear layers over weights packed for oneDNN.

Every token of every step goes through the linear layers, so their speed is
most of a forward's. `F.linear` goes to MKL, which on the CPUs this was
measured on (AMD EPYC, MKL 2024) reads the weights at 7-12 GB/s at 1-16 rows,
a fifth to a third of what the memory gives (~35 GB/s read), slowest at 2
rows. The same products through oneDNN, over weights reordered once into its
blocked layout (`_reorder_linear_weight`), measured over the bundled model's
weight shapes (`benchmarks/bench_linear.py`): 1.7x faster at 1 row, 2.1-2.3x
at 2 and 8, 1.9x at 16, 1.2-1.3x for a 512-row prefill chunk.

They also round alike whatever the number of rows: a row comes out bit-identical
among 2 or 700 rows (one row alone may differ: a matrix-vector kernel), where
MKL's rows differ at 2-3, 5-7 and 9-11 rows. That is what lets the ragged batch
keep a sequence's KV independent of what else runs (`DeterministicRows` measures
it at start-up, on the packed layers).

Packing replaces each weight by its packed copy, so the model's memory does not
grow, except for an output layer tied to the input embedding: the embedding
keeps the plain copy it looks tokens up in. Float32 weights on CPU are packed
when torch has oneDNN; other layers (other dtypes were not measured) keep
`F.linear`.
"""

from __future__ import annotations

import torch

KERNEL = "onednn-packed"  # in the model's identity: KV computed another way rounds otherwise
# The row count the packed layout is chosen for: a decode step's few rows. The products
# of 1 and 512 rows measured as fast over it as over a layout packed for them.
_PACK_FOR_ROWS = 8


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose `weight` is a oneDNN packed tensor (a buffer, not a
    parameter; `weight.to_dense()` gives the original back exactly)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Make every float32 CPU `nn.Linear` of `model` a `PackedLinear`, one at a time
    (the plain weight is freed before the next is packed); the number packed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in list(model.modules()):
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        del module.weight  # unties an output layer that shared the embedding's weight
        packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)
        module.register_buffer("weight", packed_weight)
        module.__class__ = PackedLinear
        packed += 1
    return packed
