"""Linear layers packed for oneDNN: the same products, rows that round alike whatever
their number, the plain weights freed, and a tied output layer's embedding kept."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedkv.model import load_model
from pagedkv.model.fingerprint import _state_dict_digest
from pagedkv.model.linear import PackedLinear, pack_linears

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
    assert adapter.packed_linears == len(linears)
    adapter.fingerprint(16)
    assert adapter._identity is not None and '"linear": "onednn-packed"' in adapter._identity
