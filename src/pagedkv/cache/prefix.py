"""The prefix cache: the block pool, the RAM block store and the lower tiers, joined.

A request talks to it through one handle, a `RequestCache`, made by
`PrefixCache.begin`. The handle owns the request's hash chain (the prompt is
hashed once; generated tokens extend the chain), its lease on RAM blocks and
what its lookup found in the lower tiers. Used by the engine's worker thread
only; the pool's own lock keeps `stats()` readable from other threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.cache import restore
from pagedkv.cache.block import Block
from pagedkv.cache.explain import LookupParts, PrefixExplanation, explain_lookup
from pagedkv.cache.hashing import BlockHasher, ExtraKeys, HashChain, TokenIds
from pagedkv.cache.history import CacheHistory
from pagedkv.cache.leases import DEFAULT_MAX_LEASED_FRACTION, LeaseRequest, LeaseTable
from pagedkv.cache.pool import BlockPool, BlockTable, PoolStats
from pagedkv.cache.ram import RamBlockStore
from pagedkv.cache.restore import RestorePlan
from pagedkv.cache.segments import ImageHistory
from pagedkv.cache.snapshots import SnapshotStore
from pagedkv.cache.split import WindowSplit
from pagedkv.cache.tiers import Found, LowerTiers
from pagedkv.errors import OutOfBlocksError
from pagedkv.storage.base import BlockMeta, KVBlock, TierStats

log = logging.getLogger(__name__)

# Produces the KV of tokens [start, end) of the running request, `[L, 2, H, end - start, D]`.
KVSource = Callable[[int, int], torch.Tensor]
# Recurrent-state snapshots of a request, by the number of tokens they follow.
StateSnapshots = Mapping[int, torch.Tensor]


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The prefix cache's figures: the pool, then one `TierStats` per tier, RAM first."""

    namespace: str
    block_size: int
    bytes_per_token: int
    pool: PoolStats
    tiers: dict[str, TierStats]


class PrefixCache:
    """Finds, restores and stores prefix KV across all tiers, for one model namespace."""

    def __init__(
        self,
        pool: BlockPool,
        ram: RamBlockStore,
        lower: LowerTiers,
        namespace: str,
        snapshots: SnapshotStore | None = None,
        split: WindowSplit | None = None,
    ) -> None:
        self.pool = pool
        self.split = split  # None: lower tiers keep every layer of a block in one entry
        self.snapshots = snapshots  # None: the model keeps no recurrent state
        self.ram = ram
        self.lower = lower
        self.namespace = namespace
        self.hasher: BlockHasher = pool.hasher
        self.block_size = pool.block_size
        self.ram_hit_blocks = 0
        self.alloc_failures = 0
        self.history = CacheHistory()
        self.images = ImageHistory()  # where images were seen, for `image_changed`
        self.leases = LeaseTable(pool)
        self.set_max_leased_fraction(DEFAULT_MAX_LEASED_FRACTION)
        pool.on_evict = self._evicted

    def set_max_leased_fraction(self, fraction: float) -> None:
        """A new, empty lease table allowed `fraction` of the RAM blocks; the lower tiers
        are told to keep leased blocks within that fraction of their own capacity."""
        self.leases = LeaseTable(self.pool, fraction)
        if self.lower:
            self.leases.on_grant = self._lease_lower
            self.leases.on_lapse = self._release_lower
        for tier in self.lower.tiers:
            tier.set_max_leased_fraction(fraction)

    def _lease_lower(self, hashes: Sequence[bytes], ttl_s: float) -> None:
        for tier in self.lower.tiers:
            try:
                tier.lease(hashes, ttl_s)
            except Exception:  # a tier's fault costs the lease there, never the request
                log.warning("tier %s refused a lease", tier.name, exc_info=True)

    def _release_lower(self, hashes: Sequence[bytes], _ttl_s: float) -> None:
        for tier in self.lower.tiers:
            try:
                tier.release_lease(hashes)
            except Exception:
                log.warning("tier %s failed to release a lease", tier.name, exc_info=True)

    def _evicted(self, block: Block, reason: str) -> None:
        if block.parent_key is not None and block.token_ids is not None:
            h = block.block_hash
            if reason == "capacity" and h is not None and self.leases.lapsed_at(h) is not None:
                reason = "lease_expired"
            self.history.record(block.parent_key, block.token_ids, "ram", reason)

    def explain(
        self,
        tokens: TokenIds,
        extra: ExtraKeys | None = None,
        chain: HashChain | None = None,
        other_tenants: Sequence[ExtraKeys] = (),
        think: Sequence[int] | None = None,
    ) -> PrefixExplanation:
        """What a request for `tokens` would reuse now, and why not more; read-only and
        safe on any thread (see `cache.explain`). `other_tenants`: the keys of other
        tenants whose holding the prefix the caller may be told (`other_tenant`);
        `think`: the ids that open a reasoning block, for a template that strips
        reasoning."""
        if chain is None:
            chain = self.hasher.chain(tokens, extra)
        marker = np.asarray(think, dtype=np.int32) if think else None
        parts = LookupParts(
            self.snapshots, self.split, extra, tuple(other_tenants), marker, self.images
        )
        return explain_lookup(self.pool, self.lower, self.history, chain, parts)

    def begin(self, tokens: TokenIds, extra: ExtraKeys | None = None) -> RequestCache:
        """The handle of one request whose prompt is `tokens`; hashes the prompt. A
        prompt with images is recorded where they start (`cache.segments`)."""
        handle = RequestCache(self, tokens, extra)
        if extra is not None and extra.segments:
            self.images.record(handle.chain, self.hasher.root(extra), extra, self.block_size)
        return handle

    # -- shared by the handles ------------------------------------------------

    def _allocate(self, n: int) -> list[Block] | None:
        try:
            blocks = self.pool.allocate(n)
        except OutOfBlocksError:
            self.alloc_failures += 1
            return None
        try:
            self.ram.ensure_capacity(self.pool.num_blocks)
        except BaseException:  # no memory for the slab: the blocks go back
            self.pool.free(blocks)
            raise
        return blocks

    def _meta(self, block: Block) -> BlockMeta:
        assert block.block_hash is not None and block.parent_key is not None
        assert block.token_ids is not None
        tokens = np.frombuffer(block.token_ids, dtype=np.int32).copy()
        return BlockMeta(block.block_hash, block.parent_key, tokens, self.namespace)

    def _write_through(self, blocks: Sequence[Block], sources: Sequence[str | None]) -> None:
        """Copy newly cached RAM blocks to the lower tiers; a block that came from a tier
        (`sources[i]`) is not written back to it."""
        cached = [(b, s) for b, s in zip(blocks, sources, strict=True) if b.block_hash is not None]
        if not self.lower or not cached:
            return
        kvs = self.ram.export([b.block_id for b, _ in cached], [b.num_tokens for b, _ in cached])
        by_source: dict[str | None, list[KVBlock]] = {}
        for (block, source), kv in zip(cached, kvs, strict=True):
            meta = self._meta(block)
            if self.split is None:
                by_source.setdefault(source, []).append(KVBlock(meta, kv))
                continue
            main, window = self.split.split(kv)
            # the window part first: a reader that finds a block finds its part too
            by_source.setdefault(source, []).insert(0, self.split.part_block(meta, window))
            by_source[source].append(KVBlock(meta, main))
        for source, kv_blocks in by_source.items():
            self.lower.put(kv_blocks, skip=source)

    # -- maintenance ----------------------------------------------------------

    def stats(self) -> CacheStats:
        pool = self.pool.stats()
        bpb = self.ram.layout.bytes_per_block
        ram = TierStats(
            "ram",
            hits=self.ram_hit_blocks,
            num_blocks=pool.cached,
            bytes_used=pool.cached * bpb,
            capacity_bytes=(pool.max_blocks - 1) * bpb,
            extra={
                "bytes_allocated": self.ram.bytes_allocated,
                "alloc_failures": self.alloc_failures,
            }
            | self._snapshot_stats(),
        )
        tiers = {"ram": ram} | {tier.name: tier.stats() for tier in self.lower.tiers}
        return CacheStats(
            self.namespace, self.block_size, self.ram.layout.bytes_per_token, pool, tiers
        )

    def _snapshot_stats(self) -> dict[str, float | int | str | bool]:
        store = self.snapshots
        if store is None:
            return {}
        stats: dict[str, float | int | str | bool] = {
            "snapshots": len(store),
            "snapshot_bytes": store.bytes_used,
            "snapshot_interval_tokens": store.interval_tokens,
            "snapshots_stored": store.stored,
        }
        return stats | {f"snapshot_hits_{tier}": n for tier, n in store.hits.items()}

    def clear(self) -> int:
        """Forget this namespace's unreferenced blocks in every tier; other namespaces of a
        shared SSD directory or Redis stay. Returns the RAM blocks dropped."""
        self.clear_lower()
        return self.clear_ram()

    def clear_ram(self) -> int:
        """The RAM part of `clear`, for the thread that owns the pool's tensors."""
        dropped = self.pool.evict_all()
        if self.snapshots is not None:
            self.snapshots.clear()
        self.history.cleared()
        return dropped

    def clear_lower(self) -> None:
        """The lower tiers' part of `clear`; any thread (the tiers are thread-safe), so
        the worker keeps decoding while files are unlinked and Redis is scanned."""
        for tier in self.lower.tiers:
            tier.clear(self.namespace)

    def close(self, timeout: float) -> None:
        self.lower.flush(timeout)
        self.lower.close()


class RequestCache:
    """One request's use of the prefix cache.

    Order of calls: `restore_into` once, before the first forward; then
    `cache_prompt` once the prompt's KV exists (after the first token, so that
    nothing here lands on the time to first token); `cache_finished` when the
    request ends or is preempted, with every token whose KV exists; `release`
    always, last (idempotent). Caching is best effort: a full pool skips it,
    never the request.

    `table[i]` is the RAM block holding tokens `[i * block_size, (i + 1) *
    block_size)`; the handle holds one reference on each until `release`.
    """

    def __init__(self, cache: PrefixCache, tokens: TokenIds, extra: ExtraKeys | None) -> None:
        self._cache = cache
        self.extra = extra
        self.chain = cache.hasher.chain(tokens, extra)
        self.num_prompt_tokens = self.chain.num_tokens
        self.table: list[Block] = []
        self.num_cached_tokens = 0
        self.tier_hits: dict[str, int] = {}
        # Tier of each full block the lookup found below RAM, in order after `table`.
        self._sources: list[str] = []
        # Their KV as the tier returned it: cached into RAM from here, not from the
        # request's buffers, where a sliding layer holds only its window.
        self._found_kv: list[torch.Tensor] = []
        self._found_metas: list[BlockMeta] = []
        self._found_parts: list[torch.Tensor | None] = []  # their window parts (split only)
        self._tail: Found | None = None
        # The recurrent state at the end of the restored prefix (models with state only).
        self.restored_state: torch.Tensor | None = None

    # -- lookup and restore -----------------------------------------------------

    def restore_into(self, out: torch.Tensor, limit: int) -> int:
        """Find the longest cached prefix of the prompt in any tier, at most `limit`
        tokens of it, and write its KV into `out` `[L, 2, H, >= limit, D]` (the model's
        cache buffers). Returns the number of tokens restored. While a lower tier
        reads, another thread faults `out`'s pages in, which would otherwise be a
        third of the restore's time.

        A sliding-window layer gets only its last window (`cache.window`); the rest of
        its rows in `out` are left as they were, which must be finite (zeros). For a
        model with recurrent layers the prefix ends at the last block boundary with a
        snapshot, which `restored_state` then holds for the caller to load."""
        cache, chain, bs = self._cache, self.chain, self._cache.block_size
        match = cache.pool.match_prefix(chain.tokens, self.extra, chain=chain, acquire=True)
        full = list(match.blocks[: match.num_full_blocks])
        partial = match.blocks[len(full)] if len(match.blocks) > len(full) else None
        self.table = full
        cache.ram_hit_blocks += len(match.blocks)
        plan = RestorePlan(full, partial, match.num_tokens)
        try:
            restore.find_lower(cache, chain, plan, out)
            plan.n = min(max(plan.ram_tokens, plan.reached * bs + plan.tail_tokens), limit)
            if cache.snapshots is not None:  # only where a snapshot of the state is
                restore.trim_to_snapshot(cache, chain, plan)
            if cache.split is not None:  # the sliding layers' KV, stored apart
                restore.trim_to_windows(cache, plan)
            plan.ram_tokens = min(plan.ram_tokens, plan.n)
            cache.leases.renew_hits(chain.hashes[: plan.reached])
            restore.write(cache, plan, out)
        except BaseException:
            self.release()
            raise
        finally:
            if plan.partial is not None:
                cache.pool.free([plan.partial])
        self._record(plan)
        return plan.n

    def _record(self, plan: RestorePlan) -> None:
        """Keep what a restore found (cached into RAM from here later) and count its
        tokens by tier."""
        bs, found, n = self._cache.block_size, plan.found, plan.n
        self._tail, self.restored_state = plan.tail, plan.state
        if plan.parts is not None:
            self._found_parts = plan.parts[: len(found)]
        self._sources = [f.tier for f in found]
        self._found_kv = [f.block.kv for f in found]
        self._found_metas = [f.block.meta for f in found]
        self.num_cached_tokens = n
        self._count("ram", plan.ram_tokens)
        for i, f in enumerate(found):
            self._count(f.tier, max(0, min(bs, n - (len(plan.full) + i) * bs)))
        if self._tail is not None:
            self._count(self._tail.tier, max(0, n - plan.reached * bs))

    def lease(self, tenant: str | None, request: LeaseRequest) -> int:
        """Lease the full blocks of the prompt's first `request.num_tokens` tokens (or
        renew the tenant's lease on them); returns the tokens the lease covers (0: none,
        e.g. a breakpoint before the first block boundary)."""
        bs = self._cache.block_size
        num_blocks = min(request.num_tokens, self.num_prompt_tokens) // bs
        granted = self._cache.leases.grant(
            tenant, self.chain.hashes[:num_blocks], num_blocks * bs, request
        )
        return 0 if granted is None else granted.num_tokens

    def _count(self, tier: str, num_tokens: int) -> None:
        if num_tokens:
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + num_tokens

    # -- store -----------------------------------------------------------------

    def cache_prompt(self, kv_of: KVSource, states: StateSnapshots | None = None) -> None:
        """Cache the prompt's full blocks that RAM lacks, from the request's KV: those a
        lower tier supplied are written through to the other tiers (a Redis hit goes to
        SSD), those computed here to every tier. A partial tail found in a lower tier is
        not copied up: the request caches its own tail when it finishes. `states`: the
        recurrent-state snapshots the request took, by the token count they follow."""
        sources: list[str | None] = list(self._sources)
        self._sources, self._tail = [], None
        num_full = self.num_prompt_tokens // self._cache.block_size
        added = self._cache_blocks(num_full, kv_of, self.num_prompt_tokens)
        if added:
            self._cache._write_through(added, (sources + [None] * len(added))[: len(added)])
        self._cache_states(states)

    def cache_finished(
        self, tokens: Sequence[int], kv_of: KVSource, states: StateSnapshots | None = None
    ) -> None:
        """Cache every block of `tokens` (the prompt, then the generated tokens whose KV
        exists; fewer than the prompt when a prefill stopped early) beyond `table`, the
        partial last block too, and write them through; then the snapshots."""
        known = self.chain.num_tokens
        if len(tokens) > known:
            self.chain = self._cache.hasher.extend(self.chain, tokens[known:], self.extra)
        bs = self._cache.block_size
        added = self._cache_blocks(-(-len(tokens) // bs), kv_of, len(tokens))
        if added:
            self._cache._write_through(added, [None] * len(added))
        self._cache_states(states)

    def _cache_states(self, states: StateSnapshots | None) -> None:
        """Keep each snapshot taken at the end of a full block whose KV is cached."""
        store, bs = self._cache.snapshots, self._cache.block_size
        if store is None or not states:
            return
        chain = self.chain
        for num_tokens, state in sorted(states.items()):
            j = num_tokens // bs
            if num_tokens % bs or not 0 < j <= min(len(self.table), len(chain.hashes)):
                continue
            tokens = np.asarray(chain.tokens[(j - 1) * bs : j * bs], dtype=np.int32)
            meta = BlockMeta(chain.hashes[j - 1], chain.parent_keys[j - 1], tokens,
                             self._cache.namespace)  # fmt: skip
            store.put(meta, state)

    def fork(self) -> RequestCache:
        """A handle for another sample of the same request: the same chain, and one more
        reference on every block this one holds (the pool's copy-on-write sharing: the
        blocks are never written, new tokens go to new blocks)."""
        twin = RequestCache.__new__(RequestCache)
        twin._cache, twin.extra, twin.chain = self._cache, self.extra, self.chain
        twin.num_prompt_tokens = self.num_prompt_tokens
        twin.num_cached_tokens, twin.tier_hits = self.num_cached_tokens, dict(self.tier_hits)
        twin._sources, twin._tail, twin._found_kv = [], None, []
        twin._found_metas, twin._found_parts = [], []
        twin.restored_state = None
        twin.table = self._cache.pool.fork(BlockTable("fork", self.table), "twin").blocks
        return twin

    def _cache_blocks(self, num_blocks: int, kv_of: KVSource, num_tokens: int) -> list[Block]:
        """Put the request's KV of blocks `[len(table), num_blocks)`, up to token
        `num_tokens`, into new RAM blocks and register them; returns the new blocks."""
        cache, bs = self._cache, self._cache.block_size
        start = len(self.table)
        found, self._found_kv = self._found_kv, []
        if found and cache.split is not None:
            whole = cache.split.whole(
                cache.lower.tiers, found, self._found_metas, self._found_parts
            )
            if len(whole) < len(found):  # a lost window part: nothing after it is whole
                num_blocks = min(num_blocks, start + len(whole))
            found = whole
        if num_blocks <= start:
            return []
        new = cache._allocate(num_blocks - start)
        if new is None:
            return []
        end = min(num_tokens, num_blocks * bs)
        found = found[: len(new)]
        try:
            cache.ram.write_blocks([b.block_id for b in new[: len(found)]], found)
            if len(new) > len(found):
                first = (start + len(found)) * bs
                cache.ram.scatter([b.block_id for b in new[len(found) :]], kv_of(first, end))
        except BaseException:
            cache.pool.free(new)
            raise
        self.table = self.table + new
        cache.pool.cache_blocks(self.table, self.chain.tokens[:end], self.extra, chain=self.chain)
        return new

    def release(self) -> None:
        """Drop the handle's references; its cached blocks stay findable until evicted."""
        self._tail, self._found_kv, self.restored_state = None, [], None
        self._found_metas, self._found_parts = [], []
        if self.table:
            self._cache.pool.free(self.table)
            self.table = []
