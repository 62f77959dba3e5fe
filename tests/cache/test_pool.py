"""Block pool behaviour, with exact allocation and eviction order (vLLM-style)."""

from __future__ import annotations

import dataclasses

import pytest

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.pool import Block, BlockPool, BlockTable, PoolInvariantError
from pagedkv.errors import OutOfBlocksError

BS = 4


def make_pool(max_blocks: int = 8, initial_blocks: int | None = None, **kw) -> BlockPool:  # type: ignore[no-untyped-def]
    hasher = kw.pop("hasher", None) or BlockHasher(block_size=BS, seed=b"t")
    return BlockPool(BS, max_blocks, initial_blocks, hasher=hasher, **kw)


def ids(blocks: list[Block]) -> list[int]:
    return [b.block_id for b in blocks]


def run_request(pool: BlockPool, tokens: list[int], extra: ExtraKeys | None = None) -> list[Block]:
    """What an engine does: reuse the matched full blocks, allocate and cache the rest."""
    match = pool.match_prefix(tokens, extra, acquire=True)
    full = match.blocks[: match.num_full_blocks]
    pool.free(match.blocks[match.num_full_blocks :])  # partial blocks are copied, not written
    blocks = full + pool.allocate(-(-len(tokens) // BS) - len(full))
    pool.cache_blocks(blocks, tokens, extra)
    return blocks


def snapshot(pool: BlockPool) -> tuple[object, ...]:
    pool.check()
    return (pool.stats(), [(b.ref_count, b.block_hash) for b in pool._blocks])


# -- allocation order -----------------------------------------------------------


def test_fresh_pool_hands_out_ids_in_order_and_never_the_null_block() -> None:
    pool = make_pool(max_blocks=6)
    assert ids(pool.allocate(2)) == [1, 2]
    assert ids(pool.allocate(3)) == [3, 4, 5]
    with pytest.raises(OutOfBlocksError) as err:
        pool.allocate(1)
    assert (err.value.asked, err.value.available, err.value.max_blocks) == (1, 0, 6)
    assert "asked for 1" in str(err.value)
    stats = pool.stats()
    assert (stats.num_blocks, stats.allocated, stats.free) == (6, 5, 0)


def test_pool_grows_elastically_up_to_max_blocks() -> None:
    pool = make_pool(max_blocks=10, initial_blocks=3)
    assert pool.num_blocks == 3 and pool.num_available_blocks == 9
    assert ids(pool.allocate(2)) == [1, 2]
    assert ids(pool.allocate(3)) == [3, 4, 5]
    assert pool.num_blocks == 6  # grown by exactly what was needed, ids dense
    assert ids(pool.allocate(4)) == [6, 7, 8, 9]
    assert pool.stats().num_blocks == 10
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.check()


def test_default_initial_blocks() -> None:
    assert BlockPool(max_blocks=1000).num_blocks == 256
    assert BlockPool(max_blocks=100).num_blocks == 100


def test_empty_blocks_first_then_growth_then_lru_eviction() -> None:
    pool = make_pool(max_blocks=7, initial_blocks=5)  # blocks 1..4 exist, 5..6 may grow
    a = run_request(pool, list(range(12)))  # 3 cached blocks
    assert ids(a) == [1, 2, 3]
    pool.free(a)
    # Block 4 holds nothing: it goes first; then the pool grows; cached data is evicted last.
    assert ids(pool.allocate(1)) == [4]
    assert ids(pool.allocate(2)) == [5, 6]
    assert pool.stats().evictions == 0
    # Eviction takes the sequence's tail before its head.
    assert ids(pool.allocate(1)) == [3]
    assert pool.match_prefix(list(range(12))).num_tokens == 8
    assert ids(pool.allocate(2)) == [2, 1]
    assert pool.stats().evictions == 3 and pool.stats().cached == 0
    pool.check()


def test_eviction_order_is_lru_across_requests_and_tail_first_within_one() -> None:
    pool = make_pool(max_blocks=8)
    a = run_request(pool, [1] * 12)  # blocks 1, 2, 3
    b = run_request(pool, [2] * 8)  # blocks 4, 5
    c = run_request(pool, [3] * 4)  # block 6
    pool.free(b)
    pool.free(a)
    pool.free(c)
    assert ids(pool.allocate(1)) == [7]  # still an empty block left
    assert ids(pool.allocate(6)) == [5, 4, 3, 2, 1, 6]
    pool.check()


def test_freed_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = make_pool(max_blocks=5)
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks[:2], list(range(8)))  # 1 and 2 cached; 3 and 4 not
    pool.free(blocks)
    assert ids(pool.allocate(2)) == [4, 3]
    assert pool.stats().evictions == 0
    assert ids(pool.allocate(1)) == [2]


def test_freed_blocks_stay_findable_and_can_be_revived() -> None:
    pool = make_pool()
    tokens = list(range(10))
    blocks = run_request(pool, tokens)
    pool.free(blocks)
    assert pool.stats().allocated == 0 and pool.stats().cached == 3
    match = pool.match_prefix(tokens)
    assert match.blocks == blocks and match.num_tokens == 10
    assert all(b.ref_count == 0 for b in blocks)  # a lookup takes no references
    pool.acquire(match.blocks)
    assert [b.ref_count for b in blocks] == [1, 1, 1]
    assert pool.stats().allocated == 3
    pool.check()


def test_acquire_protects_blocks_from_eviction() -> None:
    pool = make_pool(max_blocks=4)
    blocks = run_request(pool, list(range(12)))
    pool.free(blocks)
    pool.acquire([blocks[1]])
    assert ids(pool.allocate(2)) == [3, 1]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert blocks[1].block_hash is not None


def test_match_prefix_does_not_change_eviction_order() -> None:
    def order(touch: bool) -> list[int]:
        pool = make_pool(max_blocks=7)
        a, b = run_request(pool, [1] * 8), run_request(pool, [2] * 8)
        pool.free(a)
        pool.free(b)
        if touch:
            assert pool.match_prefix([1] * 8).num_tokens == 8
        return ids(pool.allocate(6))

    assert order(touch=True) == order(touch=False) == [5, 6, 2, 1, 4, 3]


def test_allocate_is_all_or_nothing() -> None:
    pool = make_pool(max_blocks=6, initial_blocks=2)
    held = run_request(pool, list(range(12)))
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError) as err:
        pool.allocate(3)
    assert err.value.available == 2
    assert snapshot(pool) == before
    assert len(pool.allocate(2)) == 2
    assert held[0].ref_count == 1


# -- bad input --------------------------------------------------------------------


@pytest.mark.parametrize("n", [-1, 1.5, "2", True])
def test_allocate_refuses_bad_counts(n) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    with pytest.raises(ValueError, match="block count"):
        pool.allocate(n)
    assert pool.allocate(0) == []


def test_double_free_and_foreign_blocks_leave_the_pool_unchanged() -> None:
    pool, other = make_pool(), make_pool()
    a, b = pool.allocate(2)
    pool.free([b])
    before = snapshot(pool)
    cases = [
        ([a, b], "not referenced"),  # b already free: nothing at all is freed
        ([a, a], "freed 2 times"),
        ([a, other.allocate(1)[0]], "not a block this pool"),
        ([a, pool._blocks[0]], "not a block this pool"),
        ([a, "block"], "not a block this pool"),
        ([a, Block(1)], "not a block this pool"),
    ]
    for blocks, words in cases:
        with pytest.raises(ValueError, match=words):
            pool.free(blocks)  # type: ignore[arg-type]
        assert snapshot(pool) == before
    with pytest.raises(ValueError, match="holds no cached data"):
        pool.acquire([b])
    assert snapshot(pool) == before


def test_constructor_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError, match="power of two"):
        BlockPool(block_size=3)
    with pytest.raises(ValueError, match="differs"):
        BlockPool(block_size=8, hasher=BlockHasher(block_size=4))
    with pytest.raises(ValueError, match="max_blocks"):
        BlockPool(max_blocks=1)
    with pytest.raises(ValueError, match="initial_blocks"):
        BlockPool(max_blocks=4, initial_blocks=5)


# -- matching -----------------------------------------------------------------------


def test_partial_tail_is_cached_and_matched_token_by_token() -> None:
    pool = make_pool()
    turn1 = list(range(10))  # blocks of 4, 4, 2
    blocks = run_request(pool, turn1)
    assert [b.num_tokens for b in blocks] == [4, 4, 2]
    pool.free(blocks)
    turn2 = [*turn1, 50, 51, 52]
    match = pool.match_prefix(turn2)
    assert match.num_tokens == 10 and match.blocks == blocks and match.num_full_blocks == 2
    assert pool.match_prefix(turn1[:9]).num_tokens == 9
    assert pool.match_prefix([*turn1[:9], 77]).num_tokens == 9


def test_match_extends_into_a_full_block_that_diverges_mid_block() -> None:
    pool = make_pool()
    blocks = run_request(pool, list(range(12)))
    match = pool.match_prefix([0, 1, 2, 3, 4, 5, 99, 99, 8])
    assert match.blocks == blocks[:2] and match.num_tokens == 6
    assert match.hashes == [blocks[0].block_hash]
    assert pool.match_prefix([0, 1, 2, 3, 99]).num_tokens == 4
    assert pool.match_prefix([5, 1, 2]).num_tokens == 0


def test_match_picks_the_child_sharing_the_most_tokens() -> None:
    pool = make_pool()
    short = run_request(pool, [0, 1, 2, 3, 4, 5, 6, 9])
    long = run_request(pool, [0, 1, 2, 3, 4, 5, 9, 9])
    match = pool.match_prefix([0, 1, 2, 3, 4, 5, 9, 7])
    assert match.blocks == [short[0], long[1]] and match.num_tokens == 7
    assert pool.match_prefix([0, 1, 2, 3, 4, 5, 6, 7]).blocks[1] is short[1]


def test_hit_and_query_tokens_are_counted_in_tokens() -> None:
    pool = make_pool()
    run_request(pool, list(range(10)))  # query 10, hit 0
    pool.match_prefix(list(range(6)))  # hit 6
    pool.match_prefix([9, 9, 9])  # hit 0
    stats = pool.stats()
    assert (stats.query_tokens, stats.hit_tokens) == (19, 6)
    assert stats.hit_rate == pytest.approx(6 / 19)


def test_match_with_acquire_takes_references_atomically() -> None:
    pool = make_pool()
    blocks = run_request(pool, list(range(8)))
    pool.free(blocks)
    match = pool.match_prefix(list(range(8)), acquire=True)
    assert [b.ref_count for b in match.blocks] == [1, 1]
    assert pool.stats().allocated == 2


def test_cache_blocks_skips_cached_blocks_and_duplicates() -> None:
    pool = make_pool()
    first = run_request(pool, list(range(8)))
    twin = pool.allocate(2)  # the same tokens computed again, e.g. concurrently
    assert pool.cache_blocks(twin, list(range(8))) == 0
    assert [b.block_hash for b in twin] == [None, None]
    assert pool.cache_blocks(first, list(range(8))) == 0
    assert pool.match_prefix(list(range(8))).blocks == first
    with pytest.raises(ValueError, match="freed 2 times"):
        pool.free(first + first)
    pool.free(first)
    with pytest.raises(ValueError, match="not referenced"):
        pool.cache_blocks(first, list(range(8)))


def test_caching_disabled_keeps_nothing() -> None:
    pool = make_pool(enable_caching=False)
    blocks = pool.allocate(2)
    assert pool.cache_blocks(blocks, list(range(8))) == 0
    pool.free(blocks)
    assert pool.match_prefix(list(range(8))).num_tokens == 0
    assert ids(pool.allocate(2)) == [3, 4]  # FIFO over empty blocks
    assert pool.stats().cached == 0


def test_evict_all_drops_only_unreferenced_cached_blocks() -> None:
    pool = make_pool()
    kept = run_request(pool, [1] * 8)
    dropped = run_request(pool, [2] * 8)
    pool.free(dropped)
    assert pool.evict_all() == 2
    assert pool.match_prefix([2] * 8).num_tokens == 0
    assert pool.match_prefix([1] * 8).blocks == kept
    assert pool.stats().cached == 2 and pool.stats().evictions == 2
    assert ids(pool.allocate(2)) == [5, 6]  # the cleared blocks come last, as empty ones
    pool.check()


# -- isolation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "queried", "hit"),
    [
        (ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="a"), 10),
        (ExtraKeys(cache_salt="a"), ExtraKeys(cache_salt="b"), 0),
        (ExtraKeys(cache_salt="a"), None, 0),
        (ExtraKeys(adapter="lora1"), ExtraKeys(adapter="lora2"), 0),
        (ExtraKeys(adapter="x"), ExtraKeys(cache_salt="x"), 0),
        (ExtraKeys(segments=[(6, "img1")]), ExtraKeys(segments=[(6, "img1")]), 10),
        (ExtraKeys(segments=[(6, "img1")]), ExtraKeys(segments=[(6, "img2")]), 4),
        (ExtraKeys(segments=[(6, "img1")]), None, 4),
    ],
)
def test_salt_adapter_and_segments_isolate_cached_prefixes(stored, queried, hit) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    tokens = list(range(10))
    pool.free(run_request(pool, tokens, stored))
    assert pool.match_prefix(tokens, queried).num_tokens == hit


def test_namespaces_do_not_share_hashes() -> None:
    a = make_pool(hasher=BlockHasher(BS, namespace="model-a", seed=b"s"))
    b = make_pool(hasher=BlockHasher(BS, namespace="model-b", seed=b"s"))
    ha = run_request(a, list(range(8)))
    hb = run_request(b, list(range(8)))
    assert {x.block_hash for x in ha}.isdisjoint({x.block_hash for x in hb})


# -- collisions --------------------------------------------------------------------


class CollidingHasher(BlockHasher):
    """Every block hashes alike: only verification keeps requests apart."""

    def hash_block(self, parent_key: bytes, token_bytes: bytes) -> bytes:
        return b"\x00" * 16


def test_a_hash_collision_is_a_miss_never_a_wrong_hit() -> None:
    pool = make_pool(hasher=CollidingHasher(BS, seed=b"t"))
    blocks = run_request(pool, [1, 2, 3, 4, 5, 6, 7, 8])
    assert [b.block_hash is not None for b in blocks] == [True, False]
    assert pool.match_prefix([9, 9, 9, 9, 5, 6, 7, 8]).num_tokens == 0
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).num_tokens == 4
    assert pool.match_prefix([1, 2, 9, 9]).num_tokens == 2  # a real common prefix
    pool.check()


class PairCollidingHasher(BlockHasher):
    """Block [8,8,8,8] hashes like block [9,9,9,9] (both right after the root)."""

    def hash_block(self, parent_key: bytes, token_bytes: bytes) -> bytes:
        if token_bytes == bytes.fromhex("08000000") * 4:
            token_bytes = bytes.fromhex("09000000") * 4
        return super().hash_block(parent_key, token_bytes)


def test_a_collision_below_a_cached_child_cannot_splice_prefixes() -> None:
    pool = make_pool(max_blocks=3, hasher=PairCollidingHasher(BS, seed=b"t"))
    x0, x1 = run_request(pool, [9, 9, 9, 9, 5, 5, 5, 5])
    pool.free([x0])
    pool.free([x1])
    assert pool.allocate(1) == [x0]  # evicts [9,9,9,9]; its child stays cached
    pool.free([x0])
    y = run_request(pool, [8, 8, 8, 8])
    assert y[0].block_hash == x1.parent_key  # the collision
    # x1 was computed after [9,9,9,9], so it must not follow [8,8,8,8].
    assert pool.match_prefix([8, 8, 8, 8, 5, 5, 5, 5]).num_tokens == 4
    assert pool.match_prefix([8, 8, 8, 8, 5, 5, 5]).num_tokens == 4
    pool.check()


def test_a_child_outliving_its_parent_is_replaced_when_the_prefix_is_recomputed() -> None:
    pool = make_pool(max_blocks=8)
    tokens = [1, 1, 1, 1, 2, 2, 2, 2]
    x = BlockTable("x", run_request(pool, tokens))
    y = pool.fork(x, "y")
    parent, child = x.blocks
    pool.make_writable(x, 0)
    pool.make_writable(y, 0)  # the parent is now unreferenced, its child is not
    pool.free(pool.allocate(4))  # ... and the parent gets evicted
    assert parent.block_hash is None and child.block_hash is not None
    assert pool.match_prefix(tokens).num_tokens == 0
    again = run_request(pool, tokens)
    # The old child cannot prove it followed this parent: the new one takes its place.
    assert child.block_hash is None and child.ref_count == 2
    assert pool.match_prefix(tokens).blocks == again
    pool.check()


# -- copy on write -------------------------------------------------------------------


def test_fork_shares_and_make_writable_copies_once() -> None:
    pool = make_pool()
    table = BlockTable("a", pool.allocate(2))
    child = pool.fork(table, "b")
    assert child.blocks == table.blocks and pool.stats().shared == 2
    old = child.blocks[1]
    new = pool.make_writable(child, 1)
    assert new is not old and child.blocks == [table.blocks[0], new]
    assert (old.ref_count, new.ref_count) == (1, 1)
    assert pool.make_writable(child, 1) is new  # already private: no second copy
    assert pool.make_writable(table, 1) is old  # the parent is sole owner again
    stats = pool.stats()
    assert (stats.shared, stats.cow_copies, stats.allocated) == (1, 1, 3)
    pool.check()


def test_cached_blocks_are_read_only_even_when_held_alone() -> None:
    pool = make_pool()
    blocks = run_request(pool, list(range(6)))  # the partial tail [4, 5] is cached
    table = BlockTable("a", blocks)
    old = table.blocks[1]
    new = pool.make_writable(table, 1, release_old=False)
    assert new is not old and old.ref_count == 1  # kept until the caller copied
    pool.free([old])
    assert pool.match_prefix(list(range(6))).blocks == [blocks[0], old]  # still cached
    assert pool.stats().cow_copies == 1


def test_make_writable_without_room_leaves_the_table_alone() -> None:
    pool = make_pool(max_blocks=3)
    table = BlockTable("a", pool.allocate(2))
    fork = pool.fork(table, "b")
    with pytest.raises(OutOfBlocksError):
        pool.make_writable(fork, 0)
    assert fork.blocks == table.blocks and pool.stats().cow_copies == 0
    pool.check()


# -- check() ------------------------------------------------------------------------


def test_check_catches_corrupted_bookkeeping() -> None:
    pool = make_pool()
    blocks = run_request(pool, list(range(8)))
    pool.check()
    blocks[0].ref_count += 1  # a reference the pool never counted
    with pytest.raises(PoolInvariantError, match="shared"):
        pool.check()
    blocks[0].ref_count -= 1
    blocks[1].token_ids = b"\x00" * 16  # cached data changed behind the hash
    with pytest.raises(PoolInvariantError, match="hash does not match"):
        pool.check()


def test_stats_is_a_frozen_snapshot() -> None:
    pool = make_pool()
    stats = pool.stats()
    pool.allocate(1)
    assert stats.allocated == 0 and pool.stats().allocated == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.allocated = 5  # type: ignore[misc]
