"""Every error path of the prefix cache gives back what it took: faults injected into
the lower tiers and the RAM store, then a leak check on the pool."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from memory_tier import MemoryTier, fake_kv
from test_prefix import BS, KV_SHAPE, LAYOUT, make_cache, serve

from pagedkv.cache.prefix import PrefixCache
from pagedkv.cache.tiers import LowerTiers
from pagedkv.storage.base import BlockMeta, KVBlock

PROMPT = list(range(3, 3 + 4 * BS + 2))  # four full blocks and a partial one


def pool_state(cache: PrefixCache) -> tuple[int, int, list[int]]:
    pool = cache.pool
    stats = pool.stats()
    return stats.allocated, stats.free, [b.ref_count for b in pool._blocks]


def assert_no_leak(cache: PrefixCache, before: tuple[int, int, list[int]]) -> None:
    cache.pool.check()
    allocated, free, refs = pool_state(cache)
    assert allocated == 0, f"{allocated} blocks still referenced"
    assert refs[: len(before[2])] == before[2] and not any(refs)
    assert free >= before[1]


def lookup(cache: PrefixCache, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """One lookup and its release, as the worker runs it (a raising lookup is released)."""
    handle = cache.begin(prompt)
    out = torch.zeros(*KV_SHAPE[:3], len(prompt), LAYOUT.head_dim)
    try:
        n = handle.restore_into(out, len(prompt) - 1)
        return n, out[..., :n, :]
    finally:
        handle.release()


def warm(tier: MemoryTier) -> PrefixCache:
    """A cache whose RAM holds PROMPT's first two blocks and whose tier holds all of it."""
    writer = make_cache(tier)
    serve(writer, PROMPT, [1])
    cache = make_cache(tier)
    serve(cache, PROMPT[: 2 * BS], [1])
    return cache


class Liar(MemoryTier):
    """A tier whose answers break the contract in one chosen way."""

    def __init__(self, how: Callable[[MemoryTier, list[KVBlock | None]], list]) -> None:
        super().__init__("redis")
        self.how = how

    def get(self, hashes):  # type: ignore[no-untyped-def]
        return self.how(self, super().get(hashes))


def _retyped(blocks: list[KVBlock | None]) -> list:
    return [b and KVBlock(b.meta, b.kv.double()) for b in blocks]


def _reshaped(blocks: list[KVBlock | None]) -> list:
    return [b and KVBlock(b.meta, b.kv[:, :1]) for b in blocks]


GARBAGE: dict[str, Callable[[MemoryTier, list[KVBlock | None]], list]] = {
    "raises": lambda t, b: (_ for _ in ()).throw(OverflowError("1e999")),
    "too few answers": lambda t, b: b[:-1],
    "not blocks": lambda t, b: [b"\x00" * 8 for _ in b],
    "another dtype": lambda t, b: _retyped(b),
    "another shape": lambda t, b: _reshaped(b),
}


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_a_tier_answering_garbage_costs_misses_not_ram_blocks(kind: str) -> None:
    tier = Liar(GARBAGE[kind])
    cache = warm(tier)
    before = pool_state(cache)
    n, kv = lookup(cache, PROMPT)
    assert n == 2 * BS, "RAM's two blocks are still used, nothing from the bad tier"
    assert torch.equal(kv, fake_kv(LAYOUT, PROMPT)[..., :n, :])
    assert_no_leak(cache, before)


def child_of(cache: PrefixCache, tokens: list[int], kv: torch.Tensor) -> KVBlock:
    chain = cache.hasher.chain(PROMPT)
    toks = np.asarray(tokens, dtype=np.int32)
    h = cache.hasher.hash_block(chain.parent_keys[4], toks.tobytes())
    return KVBlock(BlockMeta(h, chain.parent_keys[4], toks, "ns"), kv)


@pytest.mark.parametrize("kind", ["longer than a block", "another dtype", "another shape"])
def test_a_bad_partial_child_is_a_miss(kind: str) -> None:
    tier = MemoryTier("ssd")
    cache = warm(tier)
    tail = PROMPT[4 * BS :]
    full_kv = fake_kv(LAYOUT, PROMPT + [0] * (2 * BS))[..., 4 * BS :, :]
    n_tokens = 2 * BS if kind == "longer than a block" else len(tail)
    tokens = (tail + list(range(500, 500 + 2 * BS)))[:n_tokens]
    kv = full_kv[..., :n_tokens, :].clone()
    if kind == "another dtype":
        kv = kv.double()
    elif kind == "another shape":
        kv = kv[:1]
    tier.blocks = {h: b for h, b in tier.blocks.items() if b.meta.num_tokens == BS}
    tier.put([child_of(cache, tokens, kv)])
    lower = LowerTiers([tier], KV_SHAPE, block_size=BS, dtype=LAYOUT.dtype)
    chain = cache.hasher.chain(PROMPT)
    assert lower.fetch_partial(chain.parent_keys[4], chain.tokens[4 * BS :]) is None
    cache.lower = lower
    before = pool_state(cache)
    n, kv_out = lookup(cache, PROMPT)
    assert n == 4 * BS, "the full blocks, not the bad tail"
    assert torch.equal(kv_out, fake_kv(LAYOUT, PROMPT)[..., :n, :])
    assert_no_leak(cache, before)


def test_a_good_partial_child_is_still_used() -> None:
    tier = MemoryTier("ssd")
    cache = warm(tier)
    cache.lower = LowerTiers([tier], KV_SHAPE, block_size=BS, dtype=LAYOUT.dtype)
    n, kv = lookup(cache, PROMPT)
    assert n == len(PROMPT) - 1
    assert torch.equal(kv, fake_kv(LAYOUT, PROMPT)[..., :n, :])


def test_a_failing_copy_releases_the_matched_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    tier = MemoryTier("ssd")
    cache = warm(tier)
    before = pool_state(cache)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected: copy failed")

    monkeypatch.setattr("pagedkv.cache.restore.copy_prefix", broken)
    with pytest.raises(RuntimeError, match="injected"):
        lookup(cache, PROMPT)
    assert_no_leak(cache, before)


@pytest.mark.parametrize("where", ["write_blocks", "scatter", "ensure_capacity"])
def test_a_failing_promote_or_store_releases_its_new_blocks(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    tier = MemoryTier("ssd")
    cache = warm(tier)
    before = pool_state(cache)

    def broken(*args: object, **kwargs: object) -> None:
        raise MemoryError(f"injected: {where}")

    handle = cache.begin(PROMPT)
    out = torch.zeros(*KV_SHAPE[:3], len(PROMPT) + 4, LAYOUT.head_dim)
    try:
        assert handle.restore_into(out, len(PROMPT) - 1) == len(PROMPT) - 1
        out.copy_(fake_kv(LAYOUT, [*PROMPT, 1, 2, 3, 4]))
        monkeypatch.setattr(cache.ram, where, broken)
        with pytest.raises(MemoryError, match="injected"):
            # blocks 2-3 come from the tier (write_blocks), the rest are computed (scatter)
            handle.cache_finished([*PROMPT, 1, 2, 3], lambda s, e: out[..., s:e, :])
    finally:
        handle.release()
    assert_no_leak(cache, before)


def test_a_failing_write_through_keeps_the_ram_copy() -> None:
    tier = MemoryTier("ssd")
    cache = make_cache(tier)
    before = pool_state(cache)
    original_put = tier.put

    def broken_put(blocks):  # type: ignore[no-untyped-def]
        raise OSError("injected: tier write failed")

    tier.put = broken_put  # type: ignore[method-assign]
    serve(cache, PROMPT, [1])
    assert cache.lower.failures > 0
    assert cache.pool.stats().cached >= 4, "the blocks are in RAM even though the tier failed"
    assert_no_leak(cache, before)
    tier.put = original_put  # type: ignore[method-assign]
    n, kv = lookup(cache, PROMPT)
    assert n == len(PROMPT) - 1 and torch.equal(kv, fake_kv(LAYOUT, PROMPT)[..., :n, :])
