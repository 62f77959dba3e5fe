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
when torch has oneDNN, and bfloat16 ones (`--dtype bfloat16`) when the CPU
multiplies bfloat16 natively (AVX512-BF16 or AMX; measured on the bundled
model: decode 1.38x and a 512-token prefill 1.49x float32's packed layers,
every row count 1..32 bit-stable; without native support oneDNN emulates it,
and the AVX2 host measured unpacked bfloat16 at a quarter of float32's speed).
Float16 layers keep `F.linear` (not measured).

`--dtype int8` (`quantize_linears`) stores each weight as int8 with a float32
scale per output row instead, a quarter of the bytes, and multiplies through
`torch._int_mm` (int8 by int8, exact int32 sums). An int8 activation alone
loses too much (measured on the bundled model, `benchmarks/bench_kv_quality.py`:
mean KL 0.072 nats against float32, greedy agreement 0.855), so each input row
is coded as a pair: its int8 rounding at the row's absmax/127 and the int8
rounding of what that left, 254 times finer. Both rows of a pair go through one
product (the weight is read once) and are summed in float32, which brings the
error down to the weights' own (KL 0.0084, agreement 0.943). Every row is its
own: exact integer sums, a scale per row, so a row is bit-identical whatever the
number of rows. The layers that take the same input (q, k and v; gate and up)
share its codes (`_InputCodes`). Measured single-stream decode: 1.25-1.45x
float32's packed oneDNN (docs/benchmarks.md, "Compact weights").
"""

from __future__ import annotations

import os
import typing

import torch

# The oneDNN ISA cap `pagedkv/__init__.py` sets (AMX breaks bfloat16 exactness there).
ONEDNN_ISA = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL")
# In the model's identity: KV computed another way rounds otherwise.
KERNEL = f"onednn-packed:isa<={ONEDNN_ISA.lower()}"
INT8_KERNEL = "int8-pair"
# The row count the packed layout is chosen for: a decode step's few rows. The products
# of 1 and 512 rows measured as fast over it as over a layout packed for them.
_PACK_FOR_ROWS = 8


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose `weight` is a oneDNN packed tensor (a buffer, not a
    parameter; `weight.to_dense()` gives the original back exactly)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Make every float32 (and, where the CPU has it natively, bfloat16) CPU
    `nn.Linear` of `model` a `PackedLinear`, one at a time (the plain weight is freed
    before the next is packed); the number packed."""
    if not torch.backends.mkldnn.is_available():
        return 0
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    packed = 0
    for module in list(model.modules()):
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in dtypes:
            continue
        pack_linear(module)
        packed += 1
    return packed


def pack_linear(module: torch.nn.Linear) -> None:
    """Make `module` a `PackedLinear` in place (its weight: a CPU float32 or bfloat16
    tensor, with oneDNN available)."""
    weight = module.weight.detach()
    del module.weight  # unties an output layer that shared the embedding's weight
    packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)
    module.register_buffer("weight", packed_weight)
    module.__class__ = PackedLinear


class _InputCodes:
    """The int8 codes of the last input one model's `Int8Linear` layers saw, so the
    layers reading one tensor (q, k and v; gate and up) code it once. Keyed on the
    tensor object, held until the next input: the decoders this serves make a new
    tensor for every new activation and never write into one between its readers."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.codes = torch.empty(0, dtype=torch.int8)
        self.scales = torch.empty(0)

    def code(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[2 * rows, K]` int8 (each row's coarse codes, then the fine codes of
        what they left) and `[rows, 1]` float32, the scale of one fine unit."""
        if x is not self.input:
            rows = x.reshape(-1, x.shape[-1])
            absmax = rows.abs().amax(-1, keepdim=True).clamp_(min=1e-30)
            scaled = rows * absmax.reciprocal().mul_(127)
            coarse = scaled.round()
            fine = scaled.sub_(coarse).mul_(_FINE).round_()  # |fine| <= 127
            self.codes = torch.cat([coarse, fine]).to(torch.int8)
            self.scales = absmax.mul_(1 / (127 * _FINE))
            self.input = x
        return self.codes, self.scales

    def forget(self) -> None:
        """Code the next input afresh, whatever object it is: generated code (the
        compiled decode step) may hand over a buffer it reused for another activation."""
        self.input = None


_FINE = 254  # the fine code's unit is 1/254 of the coarse one's


class Int8Linear(torch.nn.Linear):
    """An `nn.Linear` whose `weight` is int8 codes `[out, in]` with a float32
    `scale` per output row (both buffers): weight ~= codes * scale[:, None]."""

    scale: torch.Tensor
    inputs: _InputCodes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes, scales = self.inputs.code(x)
        rows = scales.shape[0]
        sums = torch._int_mm(codes, self.weight.t()).float()
        y = torch.add(sums[rows:], sums[:rows], alpha=_FINE).mul_(scales).mul_(self.scale)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


def int8_side_by_side(layers: typing.Sequence[Int8Linear]) -> Int8Linear:
    """One `Int8Linear` computing `layers`' outputs side by side (a copy of their codes
    and scales, with input codes of its own)."""
    first = layers[0]
    fused = torch.nn.utils.skip_init(
        torch.nn.Linear, first.in_features, sum(x.out_features for x in layers), bias=False
    )
    del fused.weight
    fused.register_buffer("weight", torch.cat([layer.weight for layer in layers]))
    fused.register_buffer("scale", torch.cat([layer.scale for layer in layers]))
    if first.bias is not None:
        bias = torch.cat([typing.cast(torch.Tensor, layer.bias) for layer in layers])
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    fused.__class__ = Int8Linear
    typing.cast(Int8Linear, fused).inputs = _InputCodes()
    return typing.cast(Int8Linear, fused)


def quantize_linears(model: torch.nn.Module) -> int:
    """Make every float32 CPU `nn.Linear` of `model` an `Int8Linear` (per-row absmax
    scales; the float weight is freed, a tied output layer gets its own codes); the
    number made."""
    shared = _InputCodes()
    made = 0
    for module in list(model.modules()):
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight.detach()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            continue
        scale = weight.abs().amax(1).clamp_(min=1e-30) / 127
        codes = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        del module.weight
        module.register_buffer("weight", codes)
        module.register_buffer("scale", scale)
        module.__class__ = Int8Linear
        typing.cast(Int8Linear, module).inputs = shared
        made += 1
    return made
