"""GrowableLayer appends in place and must read exactly like transformers' DynamicLayer."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pagedkv.model import load_model
from pagedkv.model.kv_layer import GrowableLayer


def test_appends_grow_and_crop_like_dynamic_layer() -> None:
    plain, grow = DynamicLayer(), GrowableLayer(capacity=5)
    gen = torch.Generator().manual_seed(0)
    for n in (3, 1, 1, 4, 1, 9):  # crosses the capacity, then doubles twice
        k, v = torch.randn(1, 2, n, 4, generator=gen), torch.randn(1, 2, n, 4, generator=gen)
        want, got = plain.update(k, v), grow.update(k, v)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert grow.get_seq_length() == 19
    grow.crop(-4)
    plain.crop(-4)
    k, v = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    assert torch.equal(plain.update(k, v)[0], grow.update(k, v)[0])
    grow.reset()
    assert grow.get_seq_length() == 0


def test_forward_on_growable_cache_matches_dynamic_cache(tiny_llama_dir: Path) -> None:
    adapter = load_model(str(tiny_llama_dir))
    ids = list(range(5, 45))
    logits_plain, plain = adapter.forward(ids, DynamicCache(config=adapter.config))
    logits_grow, grow = adapter.forward(ids, adapter.new_cache(capacity=8))
    assert torch.allclose(logits_plain, logits_grow, atol=1e-5)
    for _ in range(5):  # decode past the capacity
        token = [int(logits_plain.argmax())]
        logits_plain, plain = adapter.forward(token, plain)
        logits_grow, grow = adapter.forward(token, grow)
        assert int(logits_plain.argmax()) == int(logits_grow.argmax())
    assert adapter.cache_length(grow) == len(ids) + 5
    assert all(isinstance(layer, GrowableLayer) for layer in grow.layers)
