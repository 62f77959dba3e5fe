"""The prefix cache: joins the block pool, the RAM block store and the lower tiers.

Used by the engine's worker thread only; the pool's own lock keeps `stats()`
readable from other threads.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
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
from ..storage.tiered import Found, LowerTiers

log = logging.getLogger(__name__)

# Produces the KV of tokens [start, end) of the running request, `[L, 2, H, end - start, D]`.
KVSource = Callable[[int, int], torch.Tensor]


@dataclass
class Lease:
    """The blocks one request holds, in sequence order; `table[i]` covers tokens
    `[i * block_size, (i + 1) * block_size)`. `partial` is a RAM block matched
    only in part, held until its KV has been restored."""

    extra: ExtraKeys | None
    table: list[Block] = field(default_factory=list)
    partial: Block | None = None
    tier_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class Reuse:
    """What a lookup found: the first `num_tokens` tokens of the prompt can be restored.

    The first `ram_tokens` come from RAM blocks `slots`; the rest from the
    blocks a lower tier returned, `promote` (whole blocks, in order) then
    `promote_tail` (a partial block). The lower-tier blocks go into RAM in
    `PrefixCache.promote`, after the first token: copying them there first
    would put that copy on the time to first token.
    """

    num_tokens: int = 0
    ram_tokens: int = 0
    slots: list[int] = field(default_factory=list)
    promote: list[Found] = field(default_factory=list)
    promote_tail: Found | None = None


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

    def lookup(
        self,
        tokens: list[int],
        extra: ExtraKeys | None,
        limit: int,
        out: torch.Tensor | None = None,
    ) -> tuple[Lease, Reuse]:
        """Find the longest cached prefix of `tokens` in any tier, at most `limit` tokens
        of it. The lease holds the RAM blocks it reuses until `release`. `out` is where
        `restore` will write: while a lower tier reads, another thread faults its
        pages in, which would otherwise be a third of the restore's time."""
        lease = Lease(extra)
        chain = self.hasher.chain(tokens, extra)
        bs = self.block_size
        match = self.pool.match_prefix(tokens, extra, chain=chain, acquire=True)
        full = list(match.blocks[: match.num_full_blocks])
        lease.table = full
        if len(match.blocks) > len(full):
            lease.partial = match.blocks[len(full)]
        ram_tokens = match.num_tokens
        self.ram_hit_blocks += len(match.blocks)
        reuse = Reuse()
        if self.lower and len(full) < len(chain.hashes):
            prefault: list[threading.Thread] = []

            def start_prefault() -> None:
                if out is not None:
                    prefault.append(_prefault(out))

            try:
                reuse.promote = self.lower.fetch_full(
                    chain.hashes, chain.parent_keys, chain.tokens, len(full), bs, start_prefault
                )
            except BaseException:
                self.release(lease)  # the caller never gets this lease
                raise
            finally:
                for thread in prefault:  # never leave a thread writing into `out`
                    thread.join()
        if reuse.promote and lease.partial is not None:  # whole blocks beat a partial match
            self.pool.free([lease.partial])
            lease.partial, ram_tokens = None, len(full) * bs
        num_full = len(full) + len(reuse.promote)
        tail_tokens = 0
        if self.lower and lease.partial is None and num_full * bs < len(tokens):
            hit = self.lower.fetch_partial(
                chain.parent_keys[num_full], chain.tokens[num_full * bs :]
            )
            if hit is not None:
                reuse.promote_tail, tail_tokens = hit
        reuse.num_tokens = min(max(ram_tokens, num_full * bs + tail_tokens), limit)
        reuse.ram_tokens = min(ram_tokens, reuse.num_tokens)
        reuse.slots = [b.block_id for b in full]
        if lease.partial is not None:
            reuse.slots.append(lease.partial.block_id)
        self._count(lease, "ram", reuse.ram_tokens)
        for i, f in enumerate(reuse.promote):
            self._count(lease, f.tier, max(0, min(bs, reuse.num_tokens - (len(full) + i) * bs)))
        if reuse.promote_tail is not None:
            self._count(lease, reuse.promote_tail.tier, max(0, reuse.num_tokens - num_full * bs))
        return lease, reuse

    def restore(self, lease: Lease, reuse: Reuse, out: torch.Tensor) -> None:
        """Write the KV a lookup found into `out` `[L, 2, H, reuse.num_tokens, D]` (the
        model's cache buffers), then let go of the partially matched RAM block."""
        r = reuse.ram_tokens
        if r:
            self.ram.gather_into(reuse.slots, out[:, :, :, :r])
        left = reuse.num_tokens - r
        if left:
            pieces = []
            found = reuse.promote + ([reuse.promote_tail] if reuse.promote_tail else [])
            for f in found:
                take = min(f.block.kv.shape[3], left)
                pieces.append(f.block.kv[:, :, :, :take])
                left -= take
                if not left:
                    break
            torch.cat(pieces, dim=3, out=out[:, :, :, r:])
        if lease.partial is not None:
            self.pool.free([lease.partial])
            lease.partial = None

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

    def promote(self, lease: Lease, reuse: Reuse, tokens: list[int]) -> None:
        """Copy the blocks a lookup found in lower tiers into RAM, cache them there, and
        write them through to the tiers that lack them (a Redis hit goes to SSD)."""
        bs = self.block_size
        found = reuse.promote
        if found:
            new = self._allocate(len(found))
            if new is None:
                return
            self.ram.write_blocks([b.block_id for b in new], [f.block.kv for f in found])
            lease.table = lease.table + new
            self.pool.cache_blocks(lease.table, tokens[: len(lease.table) * bs], lease.extra)
            for tier in {f.tier for f in found}:
                self.lower.put([f.block for f in found if f.tier == tier], skip=tier)
        tail = reuse.promote_tail
        if tail is not None:
            new = self._allocate(1)
            if new is None:
                return
            self.ram.write_blocks([new[0].block_id], [tail.block.kv])
            head = tokens[: len(lease.table) * bs]
            self.pool.cache_blocks(
                lease.table + new, head + tail.block.meta.token_ids.tolist(), lease.extra
            )
            self.lower.put([tail.block], skip=tail.tier)
            self.pool.free(new)  # not the request's own block: it only had its first tokens
        reuse.promote, reuse.promote_tail = [], None

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
        if lease.partial is not None:
            self.pool.free([lease.partial])
            lease.partial = None
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


def _prefault(t: torch.Tensor) -> threading.Thread:
    """Touch every page of `t`'s memory on another thread. memset through ctypes,
    not a torch op: ctypes drops the GIL, and a torch op on a second thread would
    leave an OpenMP team behind that slows the worker's forwards."""
    storage = t.untyped_storage()
    thread = threading.Thread(
        target=ctypes.memset, args=(storage.data_ptr(), 0, storage.nbytes()), daemon=True
    )
    thread.start()
    return thread
