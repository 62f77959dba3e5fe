"""``BlockPool.check()``: a full scan that re-derives every invariant and counter.

Kept apart from the pool's hot paths; it may be slow (O(num_blocks)).
"""

from __future__ import annotations

from typing import Protocol

from pagedkv.cache.block import Block, FreeBlockQueue
from pagedkv.cache.hashing import BlockHasher

__all__ = ["PoolInvariantError", "PoolState", "check_pool"]


class PoolState(Protocol):
    """The bookkeeping of a `BlockPool` that `check_pool` re-derives. Declared here,
    not imported from the pool, so that the pool can call the check without a cycle."""

    block_size: int
    max_blocks: int
    hasher: BlockHasher
    _blocks: list[Block]
    _empty: FreeBlockQueue
    _lru: FreeBlockQueue
    _leased: FreeBlockQueue
    _lease_counts: dict[bytes, int]
    _cached: dict[bytes, Block]
    _children: dict[bytes, dict[int, Block]]
    _serial: int
    _allocated: int
    _shared: int
    _query_tokens: int
    _hit_tokens: int


class PoolInvariantError(AssertionError):
    """``BlockPool.check()`` found the pool's bookkeeping inconsistent (a bug)."""


def check_pool(pool: PoolState) -> None:
    """Raise ``PoolInvariantError`` naming the first broken invariant; caller holds the lock."""

    def require(ok: bool, what: str) -> None:
        if not ok:
            raise PoolInvariantError(what)

    blocks = pool._blocks
    require(1 <= len(blocks) <= pool.max_blocks, f"num_blocks {len(blocks)} out of range")
    null = blocks[0]
    require(null.ref_count == 0 and null.block_hash is None, "null block 0 was used")
    require(null.prev_free is None and null.next_free is None, "null block 0 is queued")
    queued: dict[int, FreeBlockQueue] = {}
    for queue in (pool._empty, pool._lru, pool._leased):
        first = queue.sentinel.next_free
        require(first is not None and first.prev_free is queue.sentinel, "broken queue head")
        seen = 0
        for block in queue:
            require(
                block.next_free is not None and block.next_free.prev_free is block,
                f"broken link after block {block.block_id}",
            )
            require(block.block_id not in queued, f"block {block.block_id} queued twice")
            queued[block.block_id] = queue
            seen += 1
        require(seen == queue.size, f"queue holds {seen} blocks, size says {queue.size}")
    allocated = shared = cached = 0
    for i, block in enumerate(blocks[1:], 1):
        require(block.block_id == i, f"block at index {i} has id {block.block_id}")
        require(block.ref_count >= 0, f"block {i} has ref_count {block.ref_count}")
        allocated += block.ref_count > 0
        shared += block.ref_count > 1
        if block.ref_count:
            want = None
        elif block.block_hash is None:
            want = pool._empty
        else:
            want = pool._leased if block.block_hash in pool._lease_counts else pool._lru
        require(queued.get(i) is want, f"block {i} (ref {block.ref_count}) in the wrong queue")
        if block.block_hash is None:
            require(
                block.token_ids is None and block.parent_key is None and not block.serial,
                f"uncached block {i} keeps cached data",
            )
            continue
        cached += 1
        require(pool._cached.get(block.block_hash) is block, f"block {i} not in the hash map")
        assert block.parent_key is not None and block.token_ids is not None
        require(
            pool._children.get(block.parent_key, {}).get(i) is block,
            f"block {i} not in the children index",
        )
        require(
            0 < block.num_tokens <= pool.block_size and len(block.token_ids) % 4 == 0,
            f"block {i} holds {len(block.token_ids)} token bytes",
        )
        require(0 < block.serial <= pool._serial, f"block {i} has serial {block.serial}")
        require(
            pool.hasher.hash_block(block.parent_key, block.token_ids) == block.block_hash,
            f"block {i}'s hash does not match its parent key and tokens",
        )
    require(cached == len(pool._cached), "hash map holds blocks that are not cached")
    require(sum(map(len, pool._children.values())) == cached, "stale children entries")
    require(all(pool._children.values()), "empty children entry")
    require(allocated == pool._allocated, f"allocated {allocated} != counter {pool._allocated}")
    require(shared == pool._shared, f"shared {shared} != counter {pool._shared}")
    require(all(n > 0 for n in pool._lease_counts.values()), "a lease count <= 0")
    require(pool._hit_tokens <= pool._query_tokens, "more hit tokens than query tokens")
