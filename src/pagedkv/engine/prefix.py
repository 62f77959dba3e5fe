"""The prefix cache: joins the block pool, the RAM block store and the lower tiers.

Used by the engine's worker thread only; the pool's own lock keeps `stats()`
readable from other threads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import OutOfBlocksError
from ..hashing import BlockHasher, ExtraKeys
from ..pool import Block, BlockPool
from ..storage.base import BlockMeta, KVBlock
from ..storage.ram import RamBlockStore
from ..storage.tiered import LowerTiers

log = logging.getLogger(__name__)

# Produces the KV of tokens [start, end) of the running request, `[L, 2, H, end - start, D]`.
KVSource = Callable[[int, int], torch.Tensor]


@dataclass
class Lease:
    """The blocks one request holds, in sequence order; `table[i]` covers tokens
    `[i * block_size, (i + 1) * block_size)`."""

    extra: ExtraKeys | None
    table: list[Block] = field(default_factory=list)
    tier_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class Reuse:
    """What a lookup restored: `num_tokens` tokens of KV, `[L, 2, H, num_tokens, D]`."""

    num_tokens: int
    kv: torch.Tensor | None


class PrefixCache:
    """Finds, restores and stores a request's prefix KV across all tiers."""

    def __init__(
        self, pool: BlockPool, ram: RamBlockStore, lower: LowerTiers, namespace: str
    ) -> None:
        self.pool = pool
        self.ram = ram
        self.lower = lower
        self.namespace = namespace
        self.hasher: BlockHasher = pool.hasher
        self.block_size = pool.block_size
        self.ram_hit_blocks = 0
        self.alloc_failures = 0

    # -- lookup -------------------------------------------------------------

    def lookup(self, tokens: list[int], extra: ExtraKeys | None, limit: int) -> tuple[Lease, Reuse]:
        """Acquire the longest cached prefix of `tokens` (at most `limit` tokens are
        restored) and gather its KV. The lease holds the fully reused blocks."""
        lease = Lease(extra)
        chain = self.hasher.chain(tokens, extra)
        bs = self.block_size
        match = self.pool.match_prefix(tokens, extra, chain=chain, acquire=True)
        full = list(match.blocks[: match.num_full_blocks])
        partial: Block | None = match.blocks[len(full)] if len(match.blocks) > len(full) else None
        partial_tokens = match.num_tokens - len(full) * bs
        lease.table = full
        held_partial = partial
        self._count(lease, "ram", match.num_tokens)
        self.ram_hit_blocks += len(match.blocks)

        if self.lower and len(full) < len(chain.hashes):
            found = self.lower.fetch_full(
                chain.hashes, chain.parent_keys, chain.tokens, len(full), bs
            )
            if found:
                promoted = self._promote(
                    [f.block for f in found],
                    tokens[: (len(full) + len(found)) * bs],
                    lease,
                    sources=[f.tier for f in found],
                )
                if promoted and held_partial is not None:
                    self.pool.free([held_partial])
                    self._count(lease, "ram", -partial_tokens)
                    held_partial, partial_tokens = None, 0
        if self.lower and held_partial is None and len(lease.table) * bs < len(tokens):
            pos = len(lease.table)
            hit = self.lower.fetch_partial(chain.parent_keys[pos], chain.tokens[pos * bs :])
            if hit is not None:
                found_partial, lcp = hit
                blk = self._promote_partial(found_partial.block, tokens[: pos * bs], lease)
                if blk is not None:
                    held_partial, partial_tokens = blk, lcp
                    self._count(lease, found_partial.tier, lcp)

        slots = [b.block_id for b in lease.table] + (
            [held_partial.block_id] if held_partial else []
        )
        total = min(len(lease.table) * bs + partial_tokens, limit)
        kv = None
        if total > 0:
            nblocks = -(-total // bs)
            kv = self.ram.gather(slots[:nblocks], reuse_buffer=True)[:, :, :, :total]
        if held_partial is not None:
            self.pool.free([held_partial])
        return lease, Reuse(total, kv)

    def _count(self, lease: Lease, tier: str, num_tokens: int) -> None:
        if num_tokens:
            lease.tier_tokens[tier] = lease.tier_tokens.get(tier, 0) + num_tokens

    def _allocate(self, n: int) -> list[Block] | None:
        try:
            blocks = self.pool.allocate(n)
        except OutOfBlocksError:
            self.alloc_failures += 1
            return None
        self.ram.ensure_capacity(self.pool.num_blocks)
        return blocks

    def _promote(
        self, blocks: list[KVBlock], tokens: list[int], lease: Lease, sources: list[str]
    ) -> bool:
        """Copy lower-tier blocks into RAM after `lease.table` and cache them there."""
        new = self._allocate(len(blocks))
        if new is None:
            return False
        self.ram.write_blocks([b.block_id for b in new], [b.kv for b in blocks])
        lease.table = lease.table + new
        self.pool.cache_blocks(lease.table, tokens, lease.extra)
        for src in sources:
            self._count(lease, src, self.block_size)
        # Write-through to the tiers that did not have them (Redis hits go to SSD).
        for src in set(sources):
            self.lower.put([b for b, s in zip(blocks, sources, strict=True) if s == src], skip=src)
        return True

    def _promote_partial(self, block: KVBlock, head: list[int], lease: Lease) -> Block | None:
        new = self._allocate(1)
        if new is None:
            return None
        self.ram.write_blocks([new[0].block_id], [block.kv])
        self.pool.cache_blocks(lease.table + new, head + block.meta.token_ids.tolist(), lease.extra)
        return new[0]

    # -- store --------------------------------------------------------------

    def store(self, lease: Lease, tokens: list[int], kv_of: KVSource, tail: bool) -> None:
        """Cache the blocks of `tokens` beyond `lease.table`; with `tail`, the last
        partial block too. Best effort: when the pool is full, nothing is cached."""
        bs = self.block_size
        start = len(lease.table)
        n_full = len(tokens) // bs
        n_blocks = n_full + (1 if tail and len(tokens) % bs else 0)
        if n_blocks <= start:
            return
        new = self._allocate(n_blocks - start)
        if new is None:
            return
        end = min(len(tokens), n_blocks * bs)
        self.ram.scatter([b.block_id for b in new], kv_of(start * bs, end))
        lease.table = lease.table + new
        self.pool.cache_blocks(lease.table, tokens[:end], lease.extra)
        cached = [b for b in new if b.block_hash is not None]
        if self.lower and cached:
            kvs = self.ram.export([b.block_id for b in cached], [b.num_tokens for b in cached])
            self.lower.put([KVBlock(self._meta(b), kv) for b, kv in zip(cached, kvs, strict=True)])

    def _meta(self, block: Block) -> BlockMeta:
        assert block.block_hash is not None and block.parent_hash is not None
        assert block.token_ids is not None
        tokens = np.frombuffer(block.token_ids, dtype=np.int32).copy()
        return BlockMeta(block.block_hash, block.parent_hash, tokens, self.namespace)

    def release(self, lease: Lease) -> None:
        if lease.table:
            self.pool.free(lease.table)
            lease.table = []

    # -- maintenance --------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        pool = self.pool.stats()
        bpb = self.ram.layout.bytes_per_block
        tiers: dict[str, Any] = {
            "ram": {
                "name": "ram",
                "num_blocks": pool.cached,
                "bytes_used": pool.cached * bpb,
                "capacity_bytes": (pool.max_blocks - 1) * bpb,
                "bytes_allocated": self.ram.bytes_allocated,
                "hits": self.ram_hit_blocks,
                "alloc_failures": self.alloc_failures,
            }
        }
        for tier in self.lower.tiers:
            tiers[tier.name] = dataclasses.asdict(tier.stats())
        return {
            "pool": dataclasses.asdict(pool),
            "tiers": tiers,
            "namespace": self.namespace,
            "block_size": self.block_size,
        }

    def clear(self) -> None:
        self.pool.evict_all()
        for tier in self.lower.tiers:
            clear = getattr(tier, "clear", None)
            if clear is not None:
                clear()

    def close(self, timeout: float) -> None:
        self.lower.flush(timeout)
        self.lower.close()
