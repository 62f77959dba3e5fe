"""The RAM block store against a plain per-block reference."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache.ram import KVLayout, RamBlockStore

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=8, dtype=torch.float32)


def _reference_gather(blocks: dict[int, torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """Obviously correct: concatenate each block's [L, 2, H, bs, D] along tokens."""
    return torch.cat([blocks[s] for s in block_ids], dim=3)


def test_scatter_gather_match_reference_across_slabs() -> None:
    store = RamBlockStore(LAYOUT, max_blocks=64)
    store.ensure_capacity(64)
    assert len(store.slabs) > 1, "the test must cross slab boundaries"
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(3, 2, 2, 5 * 8, 4, generator=gen)
    block_ids = [3, 40, 17, 63, 9]
    store.scatter(block_ids, kv)
    blocks = {s: kv[:, :, :, i * 8 : (i + 1) * 8] for i, s in enumerate(block_ids)}
    for order in (block_ids, block_ids[::-1], [40, 3], [63]):
        assert torch.equal(store.gather(order), _reference_gather(blocks, order))


def test_partial_last_block_and_export() -> None:
    store = RamBlockStore(LAYOUT, max_blocks=8)
    store.ensure_capacity(8)
    kv = torch.randn(3, 2, 2, 13, 4)
    store.scatter([2, 5], kv)
    assert torch.equal(store.gather([2, 5])[:, :, :, :13], kv)
    first, tail = store.export([2, 5], [8, 5])
    assert torch.equal(first, kv[:, :, :, :8]) and torch.equal(tail, kv[:, :, :, 8:])
    first.add_(1)  # exports are private copies
    assert torch.equal(store.gather([2])[:, :, :, :8], kv[:, :, :, :8])


def test_write_blocks_from_lower_tier() -> None:
    store = RamBlockStore(LAYOUT, max_blocks=40)
    store.ensure_capacity(40)
    a, b = torch.randn(3, 2, 2, 8, 4), torch.randn(3, 2, 2, 6, 4)
    store.write_blocks([1, 33], [a, b])
    assert torch.equal(store.gather([1, 33])[:, :, :, :14], torch.cat([a, b], dim=3))


def test_capacity_is_bounded() -> None:
    store = RamBlockStore(LAYOUT, max_blocks=10)
    store.ensure_capacity(10)
    assert store.capacity >= 10 and store.bytes_allocated == store.capacity * LAYOUT.bytes_per_block
    with pytest.raises(ValueError, match="holds 10"):
        store.ensure_capacity(11)
    with pytest.raises(ValueError, match="do not fill"):
        store.scatter([1], torch.randn(3, 2, 2, 9, 4))


def test_gather_into_a_strided_cache_buffer() -> None:
    store = RamBlockStore(LAYOUT, max_blocks=40)
    store.ensure_capacity(40)
    assert len(store.slabs) > 1
    kv = torch.randn(3, 2, 2, 5 * 8, 4)
    block_ids = [1, 2, 3, 20, 33]
    store.scatter(block_ids, kv)
    blocks = {s: kv[:, :, :, i * 8 : (i + 1) * 8] for i, s in enumerate(block_ids)}
    for order, num_tokens in ((block_ids, 40), (block_ids, 37), ([33, 1], 11), ([2, 3], 16)):
        buffers = torch.zeros(3, 2, 1, 2, 64, 4)  # like the model's cache: room to grow
        store.gather_into(order, buffers[:, :, 0, :, :num_tokens])
        want = _reference_gather(blocks, order)[:, :, :, :num_tokens]
        assert torch.equal(buffers[:, :, 0, :, :num_tokens], want)
        assert not buffers[:, :, 0, :, num_tokens:].any(), "wrote past the restored tokens"
