"""4-bit weights (`--dtype int4`, `model.int4`): the kernel computes the product over the
de-quantized weight, a row rounds alike whatever the number of rows, weights already on a
Q4_1 grid (a GGUF file's) come back as their own codes, every layer that can be coded is
(a tied output layer with its own codes, the rest packed), and the adapter names its kernel
in the identity."""

from __future__ import annotations

import logging
import typing
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedkv.model import load_model
from pagedkv.model.int4 import (
    INT4_GROUP,
    INT4_KERNEL,
    Int4Linear,
    int4_codes,
    int4_dequantize,
    int4_ones_like,
    int4_side_by_side,
    int4_unpacked,
    quantize_linear_int4,
    quantize_linears_int4,
)
from pagedkv.model.linear import PackedLinear


def _layer(inp: int, out: int, seed: int, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(inp, out, bias=bias).to(torch.bfloat16).requires_grad_(False)


@pytest.mark.parametrize("outs", [(32, 32, 48), (576, 192, 192)])
def test_layers_side_by_side_give_each_layers_product(outs: tuple[int, ...]) -> None:
    """Packed tensors concatenate only where each part but the last holds a multiple of
    64 rows (32 + 32 does not): the side-by-side layer is packed afresh from the codes
    read back."""
    layers = [_layer(64, out, seed=i) for i, out in enumerate(outs)]
    codes = [int4_codes(layer.weight, torch.bfloat16)[0] for layer in layers]
    for layer in layers:
        quantize_linear_int4(layer)
    coded = [typing.cast(Int4Linear, layer) for layer in layers]
    assert all(torch.equal(int4_unpacked(c), k) for c, k in zip(coded, codes, strict=True))
    x = torch.randn(3, 64).to(torch.bfloat16)
    weight, scales_zeros, bias = int4_side_by_side(coded)
    with torch.inference_mode():
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, INT4_GROUP, scales_zeros)
        want = torch.cat([layer(x) for layer in layers], dim=-1)
    assert torch.equal(got + bias, want)


def test_int4_layer_computes_the_product_over_its_dequantized_weight() -> None:
    layer = _layer(128, 96, seed=1)
    weight = layer.weight.float().clone()
    bias = layer.bias.float().clone()
    codes, scales_zeros = int4_codes(layer.weight, torch.bfloat16)
    dequantized = int4_dequantize(codes, scales_zeros)
    quantize_linear_int4(layer)
    assert type(layer) is Int4Linear
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (96, 64)
    assert layer.scales_zeros.shape == (128 // INT4_GROUP, 96, 2)
    x = torch.randn(2, 5, 128).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x).float()
    want = x.float() @ dequantized.t() + bias
    assert got.shape == (2, 5, 96)
    # bfloat16 output rounding only: far below what 4-bit coding changed
    assert (got - want).abs().max().item() < 0.01 * want.abs().max().item()
    coding_error = (x.float() @ weight.t() + bias - want).abs().max().item()
    assert coding_error > 5 * (got - want).abs().max().item()


def test_int4_rows_are_bit_identical_whatever_their_number() -> None:
    layer = _layer(192, 208, seed=2)
    quantize_linear_int4(layer)
    x = torch.randn(9, 192).to(torch.bfloat16)
    with torch.inference_mode():
        alone = layer(x[:1])
        for rows in range(2, 10):
            assert torch.equal(layer(x[:rows])[:1], alone), rows


def test_the_row_probe_twin_has_all_ones_weights_and_the_layers_kernel() -> None:
    layer = _layer(64, 32, seed=5)
    quantize_linear_int4(layer)
    twin = int4_ones_like(layer)
    assert type(twin) is Int4Linear and twin.bias is None
    with torch.inference_mode():
        got = twin(torch.eye(64, dtype=torch.bfloat16))
    assert torch.equal(got, torch.ones(64, 32, dtype=torch.bfloat16))


def _q4_1_weights(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights as transformers de-quantizes a GGUF Q4_1 tensor: `code * d + m` per group of
    32 (d and m float16), each group holding its min (code 0) and max (code 15) as Q4_1's
    quantizer makes them; and the codes."""
    gen = torch.Generator().manual_seed(seed)
    groups = inp // INT4_GROUP
    codes = torch.randint(0, 16, (out, groups, INT4_GROUP), generator=gen)
    codes[..., 0], codes[..., 1] = 0, 15
    d = (torch.rand(out, groups, 1, generator=gen) * 0.02 + 1e-3).half().float()
    # a group's min sits some 7.5 steps below its middle, as for weights spread about 0
    below = 7.5 + 6 * torch.rand(out, groups, 1, generator=gen) - 3
    m = (-below * d).half().float()
    weight = codes.float() * d + m
    return weight.reshape(out, inp), codes.reshape(out, inp).int()


def test_weights_on_a_q4_1_grid_come_back_as_their_codes_and_requantize_alike() -> None:
    weight, q4_1_codes = _q4_1_weights(64, 256, seed=3)
    codes, scales_zeros = int4_codes(weight, torch.bfloat16)
    assert torch.equal(codes, q4_1_codes)
    dequantized = int4_dequantize(codes, scales_zeros)
    step = (scales_zeros[..., 0].float().t().repeat_interleave(INT4_GROUP, dim=1)).abs()
    # off only by the bfloat16 rounding of scale and zero: a small part of a step
    assert ((dequantized - weight).abs() / step).max().item() < 0.1
    again, again_scales_zeros = int4_codes(dequantized, torch.bfloat16)
    assert torch.equal(again, codes)
    assert torch.equal(again_scales_zeros, scales_zeros)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(320, 64)
        self.up = torch.nn.Linear(64, 128)
        self.odd = torch.nn.Linear(128, 48, bias=False)  # in-features 128: coded
        self.narrow = torch.nn.Linear(48, 64, bias=False)  # in-features 48: cannot be
        self.head = torch.nn.Linear(64, 320, bias=False)
        self.head.weight = self.embed.weight
        self.to(torch.bfloat16).requires_grad_(False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.narrow(self.odd(F.silu(self.up(self.embed(ids))))))


def test_quantize_linears_int4_codes_what_it_can_and_keeps_the_embedding() -> None:
    model = Tied()
    ids = torch.randint(0, 320, (1, 23))
    with torch.inference_mode():
        want = model(ids).float()
    embedding = model.embed.weight.clone()
    freed = weakref.ref(model.up.weight)
    assert quantize_linears_int4(model) == 2
    assert freed() is None  # the float weight went with its layer's coding
    assert all(type(m) is Int4Linear for m in (model.up, model.odd))
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    # the output layer is never coded; a layer whose in-features are no group's multiple cannot be
    assert type(model.narrow) is type(model.head) is (PackedLinear if native else torch.nn.Linear)
    assert torch.equal(model.embed.weight, embedding)
    with torch.inference_mode():
        got = model(ids).float()
    assert (got - want).abs().max().item() < 0.2 * want.abs().max().item()


def test_int4_adapter_names_its_kernel_and_answers_close_to_bfloat16(tiny_llama_dir: Path) -> None:
    bf16 = load_model(tiny_llama_dir, dtype="bfloat16")
    int4 = load_model(tiny_llama_dir, dtype="int4")
    head = int4.model.get_output_embeddings()
    linears = [m for m in int4.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Int4Linear for m in linears if m is not head)
    assert type(head) is not Int4Linear
    assert int4.linear_kernel == INT4_KERNEL and int4.dtype == torch.bfloat16
    assert int4.identity(16)["linear"] != bf16.identity(16)["linear"]
    assert int4.fingerprint(16) != bf16.fingerprint(16)
    ids = list(range(5, 45))
    with torch.inference_mode():
        a = bf16.model(input_ids=torch.tensor([ids])).logits.float()
        b = int4.model(input_ids=torch.tensor([ids])).logits.float()
    assert (a - b).abs().max().item() < 0.2 * a.abs().max().item()
    assert not torch.equal(a, b)
    stable = int4.stable_rows()
    assert stable is not None and 1 in stable.stable  # measured, not assumed


def test_int4_weights_need_the_cpu() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        load_model("smollm2-135m", device=torch.device("cuda"), dtype="int4")


def test_int4_warns_on_a_cpu_without_native_bfloat16(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    with caplog.at_level(logging.WARNING, logger="pagedkv.model.hf"):
        adapter = load_model(tiny_llama_dir, dtype="int4")
    assert adapter.linear_kernel == INT4_KERNEL  # still serves
    assert any("no native bfloat16" in r.getMessage() for r in caplog.records)
