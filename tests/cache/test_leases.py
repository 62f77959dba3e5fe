"""Leases on the block pool: evicted last, bounded by their fraction, lapsing on time.

The stateful test runs random lease, hit, flood and time-advance sequences against
a `LeaseTable` on a real `BlockPool` with a fake clock, and checks after each step
that leases never hold more than their fraction of the pool, that a lapsed lease
leaves no block leased, and that a flood of unleased traffic never evicts a leased
block while unleased ones are left to evict.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv.cache.hashing import HashChain
from pagedkv.cache.history import CacheHistory
from pagedkv.cache.leases import LeaseRequest, LeaseTable
from pagedkv.cache.pool import BlockPool
from pagedkv.config import CacheConfig

BS = 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def store(pool: BlockPool, tokens: list[int]) -> HashChain:
    """Cache `tokens`' full blocks as a finished request would, and release them."""
    chain = pool.hasher.chain(tokens)
    match = pool.match_prefix(tokens, chain=chain, acquire=True)
    have = match.blocks[: match.num_full_blocks]
    if match.num_full_blocks < len(match.blocks):
        pool.free(match.blocks[match.num_full_blocks :])
    n = len(tokens) // BS - len(have)
    table = have + pool.allocate(n)
    pool.cache_blocks(table, tokens[: len(table) * BS], chain=chain)
    pool.free(table)
    return chain


def cached(pool: BlockPool, chain: HashChain) -> int:
    return pool.peek_full_blocks(chain)


def test_a_leased_prefix_is_evicted_after_every_unleased_block() -> None:
    pool = BlockPool(block_size=BS, max_blocks=9, initial_blocks=9)
    table = LeaseTable(pool, 0.5, Clock())
    prefix = store(pool, [1, 2, 3, 4, 5, 6])  # 3 blocks, the oldest in the pool
    assert table.grant("a", prefix.hashes, 6, LeaseRequest(6, 300.0)) is not None
    for i in range(20):  # a flood of 2-block prompts: 5 unleased blocks cycle
        store(pool, [100 + i, 200 + i, 300 + i, 400 + i])
        assert cached(pool, prefix) == 3
        pool.check()
    table.check()
    unleased = store(pool, [7, 8, 9, 10])
    table.drop_all()  # the prefix goes to the back of the LRU queue: newest of all
    assert cached(pool, prefix) == 3
    store(pool, [50, 51, 52, 53, 54, 55, 56, 57, 58, 59])  # 5 blocks: the older ones go
    assert cached(pool, unleased) == 0 and cached(pool, prefix) == 3
    store(pool, [60, 61, 62, 63, 64, 65])  # now the prefix is the oldest
    assert cached(pool, prefix) == 0
    pool.check()


def test_an_expired_lease_frees_its_blocks_and_explains_itself() -> None:
    clock = Clock()
    pool = BlockPool(block_size=BS, max_blocks=6, initial_blocks=6)
    table = LeaseTable(pool, 0.5, clock)
    history = CacheHistory()

    def evicted(block: object, reason: str) -> None:
        h = block.block_hash  # type: ignore[attr-defined]
        if table.lapsed_at(h) is not None:
            reason = "lease_expired"
        history.record(block.parent_key, block.token_ids, "ram", reason)  # type: ignore[attr-defined]

    pool.on_evict = evicted
    prefix = store(pool, [1, 2, 3, 4])
    table.grant("a", prefix.hashes, 4, LeaseRequest(4, 300.0))
    clock.now += 299
    assert table.renew_hits(prefix.hashes) == 1  # a hit renews: 300 s from now
    clock.now += 299
    assert table.expire() == 0 and len(table) == 1
    clock.now += 2
    assert table.expire() == 1 and len(table) == 0
    assert pool.num_leased_hashes == 0
    for i in range(4):
        store(pool, [10 + i, 20 + i, 30 + i, 40 + i])
    assert cached(pool, prefix) == 0
    gone = history.agreement(prefix.parent_keys[0], __import__("numpy").array([1, 2]))
    assert gone is not None and gone.departure.reason == "lease_expired"


def test_leases_past_their_fraction_lapse_oldest_first() -> None:
    pool = BlockPool(block_size=BS, max_blocks=9, initial_blocks=9)  # 8 usable, 4 leasable
    table = LeaseTable(pool, 0.5, Clock())
    a = store(pool, [1, 2, 3, 4])
    b = store(pool, [5, 6, 7, 8])
    c = store(pool, [9, 10, 11, 12])
    la = table.grant("t", a.hashes, 4, LeaseRequest(4, 300.0))
    lb = table.grant("t", b.hashes, 4, LeaseRequest(4, 300.0))
    table.renew_hits(a.hashes)  # a is now the most recently renewed
    lc = table.grant("t", c.hashes, 4, LeaseRequest(4, 300.0))
    assert la and lb and lc
    assert [lease.lease_id for lease in table.list()] == [la.lease_id, lc.lease_id]
    assert pool.num_leased_hashes == 4 <= table.max_blocks
    long = store(pool, list(range(100, 112)))  # 6 blocks: more than the allowance
    ll = table.grant("t", long.hashes, 12, LeaseRequest(12, 300.0))
    assert ll is not None and len(ll.hashes) == 4 and ll.num_tokens == 8
    assert [lease.lease_id for lease in table.list()] == [ll.lease_id]
    table.check()
    pool.check()


def test_a_tenants_second_grant_renews_its_lease_and_others_get_their_own() -> None:
    pool = BlockPool(block_size=BS, max_blocks=9, initial_blocks=9)
    table = LeaseTable(pool, 1.0, Clock())
    p = store(pool, [1, 2, 3, 4])
    first = table.grant("a", p.hashes, 4, LeaseRequest(4, 300.0))
    again = table.grant("a", p.hashes, 4, LeaseRequest(4, 3600.0))
    other = table.grant("b", p.hashes, 4, LeaseRequest(4, 300.0))
    assert first is again and again is not None and again.ttl_s == 3600.0
    assert other is not None and other is not first and len(table) == 2
    assert table.drop(first.lease_id) and not table.drop(first.lease_id)
    assert pool.is_leased(p.hashes[0])  # b's lease still covers it
    table.check()


@pytest.mark.parametrize("fraction", [-0.1, 1.5, "0.5", True])
def test_a_fraction_outside_zero_to_one_is_refused(fraction: object) -> None:
    with pytest.raises(ValueError, match="max_leased_fraction"):
        CacheConfig(max_leased_fraction=fraction)  # type: ignore[arg-type]


def test_a_zero_fraction_leases_nothing() -> None:
    pool = BlockPool(block_size=BS, max_blocks=9, initial_blocks=9)
    table = LeaseTable(pool, 0.0, Clock())
    p = store(pool, [1, 2, 3, 4])
    assert table.grant("a", p.hashes, 4, LeaseRequest(4, 300.0)) is None
    assert pool.num_leased_hashes == 0


class LeaseMachine(RuleBasedStateMachine):
    MAX = 13  # 12 usable blocks

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = BlockPool(block_size=BS, max_blocks=self.MAX, initial_blocks=4)
        self.table = LeaseTable(self.pool, 0.5, self.clock)  # 6 blocks
        self.counter = 0

    def prefix(self, key: int, num_blocks: int) -> list[int]:
        return [key * 1000 + i for i in range(num_blocks * BS)]

    @rule(key=st.integers(0, 5), num_blocks=st.integers(1, 5), ttl=st.sampled_from([5.0, 60.0]))
    def lease(self, key: int, num_blocks: int, ttl: float) -> None:
        tokens = self.prefix(key, num_blocks)
        chain = store(self.pool, tokens)
        self.table.grant(f"t{key % 2}", chain.hashes, len(tokens), LeaseRequest(len(tokens), ttl))

    @rule(key=st.integers(0, 5), num_blocks=st.integers(1, 5))
    def hit(self, key: int, num_blocks: int) -> None:
        tokens = self.prefix(key, num_blocks)
        chain = self.pool.hasher.chain(tokens)
        self.table.renew_hits(chain.hashes[: self.pool.peek_full_blocks(chain)])
        store(self.pool, tokens)

    @rule(requests=st.integers(1, 8), num_blocks=st.integers(1, 6))
    def flood(self, requests: int, num_blocks: int) -> None:
        """Unrelated traffic, each request at most the pool's unleased part: no leased
        block that is cached may be evicted by it."""
        self.table.expire()
        leased = [h for h in self.pool._lease_counts if h in self.pool._cached]
        for _ in range(requests):
            self.counter += 1
            store(self.pool, [10**6 + self.counter * 100 + i for i in range(num_blocks * BS)])
        for h in leased:
            assert h in self.pool._cached or not self.pool.is_leased(h), "a leased block left"

    @rule(seconds=st.sampled_from([1.0, 4.0, 30.0, 100.0]))
    def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        self.table.expire()
        for lease in self.table.list():
            assert lease.expires > self.clock.now

    @rule()
    def drop_one(self) -> None:
        leases = self.table.list()
        if leases:
            assert self.table.drop(leases[0].lease_id)

    @invariant()
    def bounded_and_consistent(self) -> None:
        assert self.pool.num_leased_hashes <= self.table.max_blocks == 6
        self.table.check()
        self.pool.check()
        if not len(self.table):
            assert self.pool.num_leased_hashes == 0
            assert self.pool._leased.size == 0


LeaseMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase
