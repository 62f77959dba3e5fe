"""The prefix cache and its per-request handle, without a model: RAM and in-memory tiers."""

from __future__ import annotations

import random

import torch
from memory_tier import MemoryTier, fake_kv

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.pool import BlockPool
from pagedkv.cache.prefix import PrefixCache
from pagedkv.cache.ram import KVLayout, RamBlockStore
from pagedkv.cache.tiers import LowerTiers

BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=3, block_size=BS, dtype=torch.float32)
KV_SHAPE = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)


class CountingHasher(BlockHasher):
    """Counts the token bytes hashed; overriding the per-block functions turns the
    hasher's inlined loop off, so every block goes through here."""

    def __init__(self) -> None:
        super().__init__(BS, "ns", seed=b"seed")
        self.hashed_bytes = 0

    def hash_block(self, parent_key: bytes, token_bytes: bytes) -> bytes:
        self.hashed_bytes += len(token_bytes)
        return super().hash_block(parent_key, token_bytes)

    def parent_key(self, parent_hash: bytes, block_index: int, extra: ExtraKeys | None) -> bytes:
        return super().parent_key(parent_hash, block_index, extra)


def make_cache(
    *tiers: MemoryTier, max_blocks: int = 64, hasher: BlockHasher | None = None
) -> PrefixCache:
    hasher = hasher or BlockHasher(BS, "ns", seed=b"seed")
    pool = BlockPool(BS, max_blocks, hasher=hasher)
    ram = RamBlockStore(LAYOUT, max_blocks)
    lower = LowerTiers(list(tiers), KV_SHAPE, block_size=BS, dtype=LAYOUT.dtype)  # as built
    return PrefixCache(pool, ram, lower, "ns")


def serve(cache: PrefixCache, prompt: list[int], answer: list[int]) -> tuple[int, torch.Tensor]:
    """One request's life as the engine lives it; returns (tokens restored, their KV)."""
    handle = cache.begin(prompt)
    try:
        out = torch.zeros(*KV_SHAPE[:3], len(prompt) + len(answer), LAYOUT.head_dim)
        n = handle.restore_into(out, len(prompt) - 1)
        restored = out[:, :, :, :n].clone()
        full = prompt + answer
        out.copy_(fake_kv(LAYOUT, full))  # "prefill and decode"

        def kv_of(start: int, end: int) -> torch.Tensor:
            return out[:, :, :, start:end]

        handle.cache_prompt(kv_of)
        handle.cache_finished(full[:-1], kv_of)
        return n, restored
    finally:
        handle.release()


def test_a_second_request_restores_what_the_first_computed() -> None:
    cache = make_cache()
    prompt = list(range(10, 31))  # 5 full blocks and a partial one
    answer = [7, 8, 9]
    assert serve(cache, prompt, answer)[0] == 0
    again = prompt + answer[:2] + [99]
    n, kv = serve(cache, again, [1])
    assert n == len(again) - 1, "reuse is token-granular, up to the last prompt token"
    assert torch.equal(kv, fake_kv(LAYOUT, again)[:, :, :, :n])
    assert cache.pool.stats().allocated == 0
    cache.pool.check()


def test_the_prompt_is_hashed_once_and_generated_blocks_extend_the_chain() -> None:
    hasher = CountingHasher()
    cache = make_cache(MemoryTier(), hasher=hasher)
    rng = random.Random(0)
    prompt = [rng.randrange(1000) for _ in range(4 * BS + 2)]
    answer = list(range(3 * BS))
    serve(cache, prompt, answer)
    # The KV that exists (all but the last answer token) once, plus each partial last
    # block once more (the prompt's tail, then the answer's): 5x that before handles.
    computed = 4 * (len(prompt) + len(answer) - 1)
    budget = computed + 2 * 4 * BS
    assert computed <= hasher.hashed_bytes <= budget
    hasher.hashed_bytes = 0
    serve(cache, prompt, answer)
    assert hasher.hashed_bytes <= budget


def test_lower_tier_hits_are_promoted_and_written_only_where_missing() -> None:
    ssd, redis = MemoryTier("ssd"), MemoryTier("redis")
    prompt = list(range(50, 50 + 3 * BS + 1))
    serve(make_cache(ssd), prompt, [1])  # an engine that only had the SSD tier
    assert ssd.blocks and not redis.blocks
    written_to_ssd = len(ssd.puts)
    cache = make_cache(ssd, redis)  # a restart, now with Redis too: RAM is empty
    handle = cache.begin([*prompt, 5])
    out = torch.zeros(*KV_SHAPE[:3], len(prompt) + 1, LAYOUT.head_dim)
    n = handle.restore_into(out, len(prompt))
    assert n == len(prompt)
    assert handle.tier_hits == {"ssd": len(prompt)}
    assert torch.equal(out[:, :, :, :n], fake_kv(LAYOUT, prompt))
    out.copy_(fake_kv(LAYOUT, [*prompt, 5]))
    handle.cache_prompt(lambda s, e: out[:, :, :, s:e])
    handle.release()
    assert len(ssd.puts) == written_to_ssd, "a block read from SSD went back to SSD"
    assert set(redis.puts) >= {h for h in ssd.blocks if ssd.blocks[h].meta.num_tokens == BS}
    n, kv = serve(cache, [*prompt, 5], [2])
    assert n == len(prompt) and torch.equal(kv, fake_kv(LAYOUT, prompt))


def test_whole_blocks_below_beat_a_partial_ram_match() -> None:
    tier = MemoryTier("ssd")
    cache = make_cache(tier)
    base = list(range(1, 1 + 3 * BS))
    serve(cache, base, [1])
    cache.pool.evict_all()  # RAM forgets; the tier keeps every block
    serve(cache, base[: BS + 2], [1])  # RAM now holds block 0 and a partial block 1
    handle = cache.begin([*base, 9])
    out = torch.zeros(*KV_SHAPE[:3], len(base) + 1, LAYOUT.head_dim)
    n = handle.restore_into(out, len(base))
    handle.release()
    assert n == len(base)
    assert handle.tier_hits == {"ram": BS, "ssd": len(base) - BS}
    assert torch.equal(out[:, :, :, :n], fake_kv(LAYOUT, base))
    assert cache.pool.stats().allocated == 0


def test_a_failing_tier_is_a_miss_and_the_lookup_keeps_what_ram_held() -> None:
    tier = MemoryTier("ssd")
    cache = make_cache(tier)
    prompt = list(range(3, 3 + 4 * BS))
    serve(cache, prompt[: 2 * BS], [1])  # RAM holds the first two blocks
    tier.fail = True
    handle = cache.begin(prompt)
    out = torch.zeros(*KV_SHAPE[:3], len(prompt), LAYOUT.head_dim)
    assert handle.restore_into(out, len(prompt) - 1) == 2 * BS
    assert torch.equal(out[..., : 2 * BS, :], fake_kv(LAYOUT, prompt)[..., : 2 * BS, :])
    assert cache.lower.failures > 0
    handle.release()
    handle.release()  # idempotent
    assert cache.pool.stats().allocated == 0
    cache.pool.check()


def test_a_full_pool_skips_caching_not_the_request() -> None:
    cache = make_cache(max_blocks=4)  # three usable blocks
    held = cache.begin(list(range(3 * BS)))
    held.cache_finished(list(range(3 * BS)), lambda s, e: fake_kv(LAYOUT, range(3 * BS))[..., s:e])
    n, _ = serve(cache, list(range(100, 100 + 2 * BS)), [1])
    assert n == 0 and cache.alloc_failures > 0
    held.release()
    assert cache.pool.stats().allocated == 0


def test_clear_drops_this_namespace_only() -> None:
    tier = MemoryTier("ssd")
    mine, theirs = make_cache(tier), make_cache(tier)
    theirs.namespace = "other"
    serve(mine, list(range(2 * BS + 1)), [1])
    serve(theirs, list(range(2 * BS + 1)), [1])
    namespaces = {b.meta.namespace for b in tier.blocks.values()}
    assert namespaces == {"ns", "other"}
    mine.clear()
    assert {b.meta.namespace for b in tier.blocks.values()} == {"other"}
    assert mine.pool.stats().cached == 0 and theirs.pool.stats().cached > 0


def test_stats_are_typed_with_ram_first() -> None:
    tier = MemoryTier("ssd")
    cache = make_cache(tier)
    serve(cache, list(range(2 * BS + 1)), [1])
    stats = cache.stats()
    assert list(stats.tiers) == ["ram", "ssd"]
    assert stats.tiers["ram"].num_blocks == stats.pool.cached > 0
    assert stats.bytes_per_token == LAYOUT.bytes_per_token
