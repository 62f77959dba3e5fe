"""Linear layers packed for oneDNN, and int8 weights (`--dtype int8`): the same
products (int8: within its rounding), rows that round alike whatever their number,
the plain weights freed, and a tied output layer's embedding kept."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedkv.model import load_model
from pagedkv.model.fingerprint import _state_dict_digest
from pagedkv.model.linear import KERNEL, Int8Linear, PackedLinear, pack_linears, quantize_linears

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(300, 48)
        self.up = torch.nn.Linear(48, 96)
        self.down = torch.nn.Linear(96, 48, bias=False)
        self.head = torch.nn.Linear(48, 300, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(F.silu(self.up(self.embed(ids)))))


def test_packed_layers_compute_what_plain_ones_did() -> None:
    model = Tied()
    ids = torch.randint(0, 300, (1, 37))
    with torch.inference_mode():
        want = model(ids)
    digest = _state_dict_digest(model)
    assert pack_linears(model) == 3
    assert all(type(m) is PackedLinear for m in (model.up, model.down, model.head))
    with torch.inference_mode():
        got = model(ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
    # The state dict reads back what it held, so an in-memory model keeps its fingerprint.
    assert _state_dict_digest(model) == digest
    # The embedding keeps its plain weight; the output layer has its own packed copy.
    assert isinstance(model.embed.weight, torch.nn.Parameter) and not model.embed.weight.is_mkldnn
    assert model.head.weight.is_mkldnn
    assert torch.equal(model.head.weight.to_dense(), model.embed.weight)


def test_packing_frees_the_plain_weight() -> None:
    model = Tied()
    plain = weakref.ref(model.up.weight)
    pack_linears(model)
    gc.collect()
    assert plain() is None


def test_rows_round_alike_whatever_their_number() -> None:
    """A row is bit-identical among 2..300 rows; MKL's `F.linear` is not (2-3, 5-7 and
    9-11 rows differ there on the CPUs measured), which is why packing is kept."""
    torch.manual_seed(1)
    layer = torch.nn.Linear(576, 1536, bias=False)
    x = torch.randn(300, 576)
    pack_linears(layer)
    with torch.inference_mode():
        full = layer(x)
        differ = [n for n in range(2, 300) if not torch.equal(layer(x[:n]), full[:n])]
    assert differ == []


def test_the_adapter_packs_its_model_and_names_the_kernel(tiny_llama_dir: Path) -> None:
    adapter = load_model(tiny_llama_dir)
    linears = [m for m in adapter.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is PackedLinear for m in linears)
    assert adapter.linear_kernel == KERNEL
    assert adapter.identity(16)["linear"] == KERNEL


def test_int8_layers_compute_what_float_ones_did_to_the_weights_rounding() -> None:
    model = Tied()
    ids = torch.randint(0, 300, (1, 37))
    with torch.inference_mode():
        want = model(ids)
        # the float products over the int8 weights: what the pair coding of the
        # inputs must reach (the inputs' own rounding is 254 x 127 finer)
        dequantized = Tied()
    assert quantize_linears(model) == 3
    assert all(type(m) is Int8Linear for m in (model.up, model.down, model.head))
    for name in ("up", "down", "head"):
        layer = getattr(model, name)
        dequantized_weight = layer.weight.float() * layer.scale[:, None]
        getattr(dequantized, name).weight = torch.nn.Parameter(dequantized_weight)
        assert layer.weight.dtype == torch.int8
    with torch.inference_mode():
        got = model(ids)
        reference = dequantized(ids)
    assert (got - reference).abs().max().item() < 1e-3 * reference.abs().max().item()
    # the weights' rounding does move the output, by about its own size
    assert 1e-4 < (got - want).abs().max().item() < 0.05 * want.abs().max().item()
    assert isinstance(model.embed.weight, torch.nn.Parameter)  # tied embedding kept float


def test_int8_rows_are_bit_identical_whatever_their_number() -> None:
    torch.manual_seed(2)
    layer = torch.nn.Linear(576, 1536)
    x = torch.randn(300, 576) * torch.linspace(0.1, 30, 576)  # outlier-ish columns
    quantize_linears(layer)
    with torch.inference_mode():
        full = layer(x)
        differ = [n for n in range(1, 300) if not torch.equal(layer(x[:n]), full[:n])]
    assert differ == []


def test_int8_layers_reading_one_input_share_its_codes_and_only_that() -> None:
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"q": torch.nn.Linear(32, 16), "k": torch.nn.Linear(32, 8)})
    quantize_linears(model)
    x, y = torch.randn(4, 32), torch.randn(4, 32)
    with torch.inference_mode():
        alone = model["k"](y.clone())
        model["q"](x)
        shared_codes = model["q"].inputs.codes
        model["k"](x)
        assert model["k"].inputs.codes is shared_codes  # coded once for both
        assert torch.equal(model["k"](y), alone)  # a new input is coded anew


def test_int8_adapter_names_its_kernel_and_answers_close_to_float(tiny_llama_dir: Path) -> None:
    plain = load_model(tiny_llama_dir)
    int8 = load_model(tiny_llama_dir, dtype="int8")
    linears = [m for m in int8.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is Int8Linear for m in linears)
    assert int8.linear_kernel == "int8-pair" and int8.dtype == torch.float32
    assert int8.fingerprint(16) != plain.fingerprint(16)
    ids = list(range(5, 45))
    with torch.inference_mode():
        a = plain.model(input_ids=torch.tensor([ids])).logits
        b = int8.model(input_ids=torch.tensor([ids])).logits
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()


def test_int8_weights_need_the_cpu() -> None:
    with pytest.raises(ValueError, match="CPU only"):
        load_model("smollm2-135m", device=torch.device("cuda"), dtype="int8")


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no native bfloat16 on this CPU"
)
def test_bfloat16_layers_are_packed_where_the_cpu_has_bfloat16() -> None:
    torch.manual_seed(4)
    layer = torch.nn.Linear(576, 1536).to(torch.bfloat16)
    x = torch.randn(300, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        want = layer(x)
    digest = _state_dict_digest(layer)
    assert pack_linears(layer) == 1 and type(layer) is PackedLinear
    assert _state_dict_digest(layer) == digest
    with torch.inference_mode():
        full = layer(x)
        differ = [n for n in range(2, 300) if not torch.equal(layer(x[:n]), full[:n])]
    assert full.dtype == torch.bfloat16
    assert (full.float() - want.float()).abs().max().item() < 0.02 * want.abs().max().item()
    assert differ == []
