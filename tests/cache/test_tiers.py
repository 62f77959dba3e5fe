"""The walk over the tiers below RAM: runs of full blocks, partial tails, verification."""

from __future__ import annotations

import numpy as np
import torch
from memory_tier import MemoryTier, fake_kv

from pagedkv.cache.hashing import BlockHasher
from pagedkv.cache.ram import KVLayout
from pagedkv.cache.tiers import LowerTiers
from pagedkv.storage.base import BlockMeta, KVBlock

BS = 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=3, block_size=BS, dtype=torch.float32)
KV_SHAPE = (1, 2, 2, 3)
HASHER = BlockHasher(BS, "ns", seed=b"s")


def stored_blocks(tokens: list[int], upto: int | None = None) -> list[KVBlock]:
    """The blocks an engine would have stored for `tokens` (the last one may be partial)."""
    chain = HASHER.chain(tokens)
    kv = fake_kv(LAYOUT, tokens)
    out = []
    for i in range(-(-len(tokens) // BS)):
        toks = chain.tokens[i * BS : (i + 1) * BS]
        h = (
            chain.hashes[i]
            if i < len(chain.hashes)
            else HASHER.hash_block(chain.parent_keys[i], toks.tobytes())
        )
        meta = BlockMeta(h, chain.parent_keys[i], toks.copy(), "ns")
        out.append(KVBlock(meta, kv[:, :, :, i * BS : i * BS + len(toks)].clone()))
    return out[:upto]


def walk(tiers: list[MemoryTier], tokens: list[int], start: int = 0):
    chain = HASHER.chain(tokens)
    lower = LowerTiers(tiers, KV_SHAPE)
    return lower.fetch_full(chain.hashes, chain.parent_keys, chain.tokens, start, BS), chain


def test_the_run_stops_at_the_first_block_no_tier_has() -> None:
    tokens = list(range(1, 1 + 5 * BS))
    ssd, redis = MemoryTier("ssd"), MemoryTier("redis")
    blocks = stored_blocks(tokens)
    ssd.put([blocks[0], blocks[2]])
    redis.put([blocks[1], blocks[4]])  # block 3 is nowhere: block 4 is unreachable
    found, _ = walk([ssd, redis], tokens)
    assert [f.tier for f in found] == ["ssd", "redis", "ssd"]
    assert all(torch.equal(f.block.kv, b.kv) for f, b in zip(found, blocks, strict=False))
    assert blocks[4].meta.block_hash not in redis.gets, "read a block past the gap"


def test_the_first_tier_holding_a_block_serves_it() -> None:
    tokens = list(range(1, 1 + 2 * BS))
    ssd, redis = MemoryTier("ssd"), MemoryTier("redis")
    ssd.put(stored_blocks(tokens))
    redis.put(stored_blocks(tokens))
    found, _ = walk([ssd, redis], tokens)
    assert [f.tier for f in found] == ["ssd", "ssd"] and not redis.gets


def test_a_block_that_names_other_tokens_or_shape_is_a_miss() -> None:
    tokens = list(range(1, 1 + 3 * BS))
    liar = MemoryTier("ssd")
    good = stored_blocks(tokens)
    other = stored_blocks([t + 1 for t in tokens])
    # Block 1 stored under the right hash, but holding another prefix's tokens.
    forged = KVBlock(BlockMeta(good[1].meta.block_hash, other[1].meta.parent_key,
                               other[1].meta.token_ids, "ns"), other[1].kv)  # fmt: skip
    wrong_shape = KVBlock(good[2].meta, good[2].kv[:, :, :1])
    liar.put([good[0], forged, wrong_shape])
    found, _ = walk([liar], tokens)
    assert len(found) == 1


def test_the_best_partial_child_shares_the_most_tokens() -> None:
    base = list(range(1, 1 + BS))
    tier = MemoryTier("ssd")
    tier.put(stored_blocks([*base, 50, 51]))
    tier.put(stored_blocks([*base, 50, 51, 52])[1:])
    tier.put(stored_blocks([*base, 60])[1:])
    chain = HASHER.chain([*base, 50, 51, 52, 53])
    lower = LowerTiers([tier], KV_SHAPE)
    hit = lower.fetch_partial(chain.parent_keys[1], chain.tokens[BS:])
    assert hit is not None
    found, common = hit
    assert common == 3 and np.array_equal(found.block.meta.token_ids, [50, 51, 52])
    assert lower.fetch_partial(chain.parent_keys[1], np.array([70], dtype=np.int32)) is None


def test_put_skips_the_tier_a_block_came_from() -> None:
    ssd, redis = MemoryTier("ssd"), MemoryTier("redis")
    lower = LowerTiers([ssd, redis], KV_SHAPE)
    blocks = stored_blocks(list(range(2 * BS)))
    lower.put(blocks, skip="redis")
    assert len(ssd.puts) == 2 and not redis.puts
