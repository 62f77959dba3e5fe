"""Linear layers over 4-bit weights (`--dtype int4`).

Each weight is stored as 4-bit codes in groups of `INT4_GROUP` along the input
dimension, asymmetric: a group's codes 0..15 span its min to its max, and a
scale and a zero per group give the weight back as `(code - 8) * scale + zero`,
the form torch's own CPU kernel (`aten._weight_int4pack_mm_for_cpu`) multiplies
by. An eighth of float32's bytes plus 4 bytes of scale and zero per 32 weights.

The activations are bfloat16: the kernel has a fast path for them only
(measured one row through the bundled model's shapes on an AVX-512 BF16 host:
~16.5 ms a token with bfloat16 rows, ~420 ms with float32 ones, against ~25 ms
for bfloat16 weights packed for oneDNN). The rejected alternative, float32
activations over the same codes, would keep int8's exact activations but runs
25x slower.

A row comes out bit-identical whatever the number of rows (measured 1..64 rows);
`batch.DeterministicRows` still measures that at start-up, as for every kernel.

Weights that already lie on such a grid (a GGUF file's Q4_1 tensors, which
transformers de-quantizes to `code * d + m` in groups of 32) come back as their
own codes: a group's min and max are then its codes 0 and 15, so the step and
the codes are recovered (tests/model/test_int4.py, the round trip).
"""

from __future__ import annotations

import typing

import torch

# In the model's identity (`ModelAdapter.linear_kernel`): KV computed another way rounds otherwise.
INT4_KERNEL = "int4-g32"
INT4_GROUP = 32
# The packing kernel takes output features in multiples of 16 (it interleaves them).
_OUT_MULTIPLE = 16
_LEVELS = 15  # the codes 0..15
_MIDDLE = 8  # the code the kernel's zero stands for


class Int4Linear(torch.nn.Linear):
    """An `nn.Linear` whose `weight` is packed 4-bit codes (uint8 `[out, in/2]`, from
    `aten._convert_weight_to_int4pack_for_cpu`) and `scales_zeros` is `[in/32, out, 2]`
    (scale, zero) in the activation dtype, both buffers; `bias` is the original one.

    The compiled decode step (`model.compiled`) calls the kernel on `weight` and
    `scales_zeros` directly, and fuses sibling layers (`int4_side_by_side`)."""

    scales_zeros: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != self.scales_zeros.dtype:
            rows = rows.to(self.scales_zeros.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.contiguous(), self.weight, INT4_GROUP, self.scales_zeros
        )
        if self.bias is not None:
            y += self.bias
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


def int4_codes(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` `[out, in]` (in a multiple of `INT4_GROUP`) as int32 codes `[out, in]`
    in 0..15 and `scales_zeros` `[in/32, out, 2]` in `dtype`. The codes are chosen
    against the scale and zero as `dtype` rounds them, so each is the nearest point
    of the grid the kernel multiplies by."""
    out, inp = weight.shape
    w = weight.detach().float().reshape(out, inp // INT4_GROUP, INT4_GROUP)
    mn = w.amin(-1)
    mx = w.amax(-1)
    scale = ((mx - mn) / _LEVELS).clamp_(min=1e-12).to(dtype)
    zero = (mn + _MIDDLE * scale.float()).to(dtype)
    step = scale.float().unsqueeze(-1)
    codes = ((w - zero.float().unsqueeze(-1)) / step + _MIDDLE).round_().clamp_(0, _LEVELS)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return codes.reshape(out, inp).to(torch.int32), scales_zeros


def int4_dequantize(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight `[out, in]` that `codes` `[out, in]` and `scales_zeros`
    `[in/32, out, 2]` stand for: `(code - 8) * scale + zero`."""
    out, inp = codes.shape
    sz = scales_zeros.float().transpose(0, 1)  # [out, groups, 2]
    grouped = codes.float().reshape(out, inp // INT4_GROUP, INT4_GROUP) - _MIDDLE
    w = grouped * sz[..., 0:1] + sz[..., 1:2]
    return w.reshape(out, inp)


def quantize_linear_int4(module: torch.nn.Linear, dtype: torch.dtype = torch.bfloat16) -> None:
    """Make `module` an `Int4Linear` in place; its float weight is freed (an output
    layer tied to the embedding is untied: the embedding keeps its own weight)."""
    codes, scales_zeros = int4_codes(module.weight, dtype)
    del module.weight
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    del codes
    module.register_buffer("weight", packed)
    module.register_buffer("scales_zeros", scales_zeros)
    if module.bias is not None and module.bias.dtype != dtype:
        module.bias = torch.nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)
    module.__class__ = Int4Linear


def int4_unpacked(layer: Int4Linear) -> torch.Tensor:
    """`layer`'s codes `[out, in]` (int32, 0..15), read back through the kernel: the
    identity's rows times the codes at scale 1 and zero 8 (exact in bfloat16)."""
    eye = torch.eye(layer.in_features, dtype=layer.scales_zeros.dtype)
    unit = torch.empty_like(layer.scales_zeros)
    unit[..., 0], unit[..., 1] = 1, _MIDDLE
    codes = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.weight, INT4_GROUP, unit)
    return codes.t().round().to(torch.int32)


def int4_side_by_side(layers: typing.Sequence[Int4Linear]) -> tuple[torch.Tensor, ...]:
    """`(weight, scales_zeros, bias)` of one 4-bit layer computing `layers`' outputs
    side by side (bias empty where they have none). The packing interleaves output
    rows in blocks of 64, so packed tensors concatenate as they are only where each
    but the last holds a multiple of 64 rows (as in the bundled model's q/k/v and
    gate/up): checked on a row's products, and packed afresh from the codes read back
    (`int4_unpacked`, ~8 ms a layer here) where they differ."""
    weight = torch.cat([layer.weight for layer in layers])
    scales_zeros = torch.cat([layer.scales_zeros for layer in layers], dim=1)
    biases = typing.cast(list[torch.Tensor], [layer.bias for layer in layers])
    bias = torch.empty(0) if biases[0] is None else torch.cat(biases)
    row = torch.randn(1, layers[0].in_features, generator=torch.Generator().manual_seed(0))
    row = row.to(scales_zeros.dtype)
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    apart = [mm(row, layer.weight, INT4_GROUP, layer.scales_zeros) for layer in layers]
    if not torch.equal(mm(row, weight, INT4_GROUP, scales_zeros), torch.cat(apart, dim=-1)):
        codes = torch.cat([int4_unpacked(layer) for layer in layers])
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return weight, scales_zeros, bias


def int4_ones_like(layer: Int4Linear) -> Int4Linear:
    """An `Int4Linear` of `layer`'s shape and kernel whose weights are all exactly 1
    (codes 8, scale 1, zero 1) and no bias: `batch.DeterministicRows` probes it."""
    twin = torch.nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
    codes = torch.full((layer.out_features, layer.in_features), _MIDDLE, dtype=torch.int32)
    del twin.weight
    twin.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
    twin.register_buffer("scales_zeros", torch.ones_like(layer.scales_zeros))
    twin.__class__ = Int4Linear
    return typing.cast(Int4Linear, twin)


def quantize_linears_int4(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> int:
    """Make every CPU `nn.Linear` of `model` with a float32 or bfloat16 weight,
    in-features a multiple of `INT4_GROUP` and out-features a multiple of 16 (the
    packing kernel's) an `Int4Linear`, one at a time (each float
    weight is freed before the next is coded); the number made. The output layer
    is not coded: on the bundled model 4 bits there cost 0.060 nats of mean KL and
    14% of greedy tokens against float32, bfloat16 there 0.003 nats in all
    (docs/benchmarks.md, "int4 weights"); GGUF files keep it 8-bit too. The layers
    left are packed for oneDNN where `linear.pack_linears` would pack them."""
    from pagedkv.model.linear import pack_linears

    output = getattr(model, "get_output_embeddings", lambda: None)()
    made = 0
    for module in list(model.modules()):
        if type(module) is not torch.nn.Linear or module is output:
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        if module.in_features % INT4_GROUP or module.out_features % _OUT_MULTIPLE:
            continue
        quantize_linear_int4(module, dtype)
        made += 1
    pack_linears(model)  # only plain `nn.Linear`s are left to it
    return made
