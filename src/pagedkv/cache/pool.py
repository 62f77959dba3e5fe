"""The block pool: which KV block holds what, who references it, what goes next.

Metadata only; the tensors live in the storage tiers, indexed by block id.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedkv.cache.block import Block, FreeBlockQueue
from pagedkv.cache.hashing import BlockHasher, ExtraKeys, HashChain, TokenIds
from pagedkv.cache.pool_check import PoolInvariantError, check_pool
from pagedkv.errors import OutOfBlocksError

__all__ = ["Block", "BlockPool", "BlockTable", "PoolInvariantError", "PoolStats", "PrefixMatch"]


@dataclass(slots=True, eq=False)
class BlockTable:
    """A sequence's blocks in order; ``blocks[i]`` holds tokens ``[i*bs, (i+1)*bs)``."""

    table_id: Hashable
    blocks: list[Block] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a request.

    ``blocks[:len(hashes)]`` match whole blocks; ``hashes`` are their hashes.
    At most one more block follows, matched partially: it shares only its
    first ``num_tokens - len(hashes) * block_size`` tokens with the request,
    and is read-only. ``chain`` is the request's full hash chain, for lower
    tiers and for ``cache_blocks(..., chain=)``.
    """

    blocks: list[Block]
    num_tokens: int
    hashes: list[bytes]
    chain: HashChain | None = None

    @property
    def num_full_blocks(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Counters of a pool. ``num_blocks`` counts the null block 0, so
    ``allocated + free + 1 == num_blocks``; ``cached`` counts referenced and
    unreferenced blocks with a hash; ``shared`` blocks have ref_count > 1."""

    num_blocks: int
    max_blocks: int
    allocated: int
    free: int
    cached: int
    shared: int
    query_tokens: int
    hit_tokens: int
    hit_rate: float
    evictions: int
    cow_copies: int


def _common_prefix(a: bytes, b: bytes) -> int:
    """Number of leading int32 tokens two int32-LE byte strings share."""
    n = min(len(a), len(b)) >> 2
    if a[: 4 * n] == b[: 4 * n]:
        return n
    diff = np.frombuffer(a, "<i4", n) != np.frombuffer(b, "<i4", n)
    return int(diff.argmax())


class BlockPool:
    """Hands out KV blocks, counts references, keeps freed blocks findable.

    Invariants (``check()`` verifies all of them):
    - Block ids are dense in ``[0, num_blocks)``; block 0 is a null block that
      is never handed out. ``num_blocks`` grows on demand up to ``max_blocks``.
    - A non-null block with ref_count 0 is in exactly one free queue: the
      *empty* queue when it holds no cached data, else the *leased* queue when
      a lease covers its hash (``pin``), else the *cached* queue; both cached
      queues are in eviction order (front first). Referenced blocks are in none.
    - A hash is leased while ``pin`` was called for it more often than
      ``unpin``; a leased hash with no cached block stays leased, so the block
      that caches it later is leased too.
    - ``hash -> Block`` holds every cached block; the children index maps each
      cached block's parent key to it, for token-granular matching.

    Ordering: ``allocate`` takes empty blocks first (front of the empty
    queue), then grows the pool, then evicts from the front of the cached
    queue (least recently freed first), and only when it is empty from the
    front of the leased queue: a leased block goes last, whatever its age
    (O(1): two queues, never a scan for an unleased victim). ``free`` appends blocks that reach 0
    in reverse, so a sequence's tail is evicted before its head. Only
    ``acquire``, ``free`` and ``make_writable`` change the eviction order.

    Thread-safe: one lock around every public method; hashing runs outside it.
    ``on_evict(block, reason)``, when set, hears of every cached block about to
    lose its data ("capacity" or "clear"), under the lock: it must be cheap and
    must not call back into the pool.
    """

    def __init__(
        self,
        block_size: int = 64,
        max_blocks: int = 16384,
        initial_blocks: int | None = None,
        enable_caching: bool = True,
        hasher: BlockHasher | None = None,
    ) -> None:
        if hasher is None:
            hasher = BlockHasher(block_size=block_size)
        elif hasher.block_size != block_size:
            raise ValueError(
                f"hasher.block_size={hasher.block_size} differs from block_size={block_size}"
            )
        if not isinstance(max_blocks, int) or max_blocks < 2:
            raise ValueError(
                f"max_blocks must be an int >= 2 (block 0 is reserved), got {max_blocks!r}"
            )
        if initial_blocks is None:
            initial_blocks = min(256, max_blocks)
        if not isinstance(initial_blocks, int) or not 1 <= initial_blocks <= max_blocks:
            raise ValueError(
                f"initial_blocks must be in [1, max_blocks={max_blocks}], got {initial_blocks!r}"
            )
        self.hasher = hasher
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.enable_caching = enable_caching
        self._lock = threading.Lock()
        self._blocks: list[Block] = [Block(i) for i in range(initial_blocks)]
        self._empty = FreeBlockQueue(Block(-1))
        self._lru = FreeBlockQueue(Block(-2))
        self._leased = FreeBlockQueue(Block(-3))
        self._lease_counts: dict[bytes, int] = {}
        for block in self._blocks[1:]:
            self._empty.append(block)
        self._cached: dict[bytes, Block] = {}
        self._children: dict[bytes, dict[int, Block]] = {}
        self._serial = 0
        self._allocated = self._shared = 0
        self._query_tokens = self._hit_tokens = 0
        self._evictions = self._cow_copies = 0
        self.on_evict: Callable[[Block, str], None] | None = None

    # -- cheap accessors -------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_available_blocks(self) -> int:
        """How many blocks ``allocate`` could hand out now (free + room to grow); unlocked."""
        free = self._empty.size + self._lru.size + self._leased.size
        return free + self.max_blocks - len(self._blocks)

    @property
    def num_leased_hashes(self) -> int:
        """How many distinct block hashes a lease covers now (cached or not); unlocked."""
        return len(self._lease_counts)

    # -- references --------------------------------------------------------------

    def allocate(self, n: int) -> list[Block]:
        """``n`` blocks with ref_count 1, all or nothing (``OutOfBlocksError``)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"allocate() needs a block count >= 0, got {n!r}")
        with self._lock:
            blocks = self._take(n)
            for block in blocks:
                block.ref_count = 1
            self._allocated += n
            return blocks

    def free(self, blocks: Sequence[Block]) -> None:
        """Drop one reference each; ``blocks`` in sequence order (head first)."""
        with self._lock:
            self._validate(blocks, held=True, freeing=True)
            self._release(blocks)

    def acquire(self, blocks: Sequence[Block]) -> None:
        """One more reference each; an unreferenced cached block leaves the queue."""
        with self._lock:
            self._validate(blocks, held=False)
            for block in blocks:
                if block.ref_count == 0 and block.block_hash is None:
                    raise ValueError(
                        f"block {block.block_id} is free and holds no cached data; acquire "
                        "only blocks you hold or blocks that match_prefix returned"
                    )
            self._acquire(blocks)

    def _acquire(self, blocks: Sequence[Block]) -> None:
        for block in blocks:
            if block.ref_count == 0:
                self._cached_queue(block).remove(block)
                self._allocated += 1
            elif block.ref_count == 1:
                self._shared += 1
            block.ref_count += 1

    def _release(self, blocks: Sequence[Block]) -> None:
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._allocated -= 1
                (self._empty if block.block_hash is None else self._cached_queue(block)).append(
                    block
                )
            elif block.ref_count == 1:
                self._shared -= 1

    def _cached_queue(self, block: Block) -> FreeBlockQueue:
        """The queue an unreferenced cached ``block`` is (or goes) in."""
        return self._leased if block.block_hash in self._lease_counts else self._lru

    # -- leases ------------------------------------------------------------------

    def pin(self, hashes: Sequence[bytes]) -> None:
        """One more lease on each hash: its block, now or once cached, is evicted after
        every unleased one. A hash given twice counts twice."""
        with self._lock:
            counts = self._lease_counts
            for h in hashes:
                n = counts.get(h, 0)
                if n == 0:
                    block = self._cached.get(h)
                    if block is not None and block.ref_count == 0:
                        self._lru.remove(block)
                        self._leased.append(block)
                counts[h] = n + 1

    def unpin(self, hashes: Sequence[bytes]) -> None:
        """Undo one ``pin`` of each hash; a block whose last lease goes returns to the
        back of the cached queue (just released), to age from there."""
        with self._lock:
            counts = self._lease_counts
            for h in hashes:
                n = counts.get(h, 0)
                if n == 0:
                    raise ValueError(f"unpin of hash {h.hex()[:12]} that no lease holds")
                if n > 1:
                    counts[h] = n - 1
                    continue
                del counts[h]
                block = self._cached.get(h)
                if block is not None and block.ref_count == 0:
                    self._leased.remove(block)
                    self._lru.append(block)

    def is_leased(self, block_hash: bytes) -> bool:
        return block_hash in self._lease_counts

    def _validate(self, blocks: Sequence[Block], held: bool, freeing: bool = False) -> None:
        """Every block is this pool's; when ``held``, referenced (often enough to free)."""
        owned, num_blocks = self._blocks, len(self._blocks)
        for block in blocks:
            try:
                bid = block.block_id
                mine = 0 < bid < num_blocks and owned[bid] is block
            except (AttributeError, TypeError):
                mine = False
            if not mine:
                raise ValueError(f"{block!r} is not a block this pool handed out")
            if held and block.ref_count <= 0:
                raise ValueError(f"block {bid} is not referenced (freed twice?)")
        if freeing and len({b.block_id for b in blocks}) != len(blocks):
            counts: dict[int, int] = {}
            for block in blocks:
                counts[block.block_id] = counts.get(block.block_id, 0) + 1
                if counts[block.block_id] > block.ref_count:
                    raise ValueError(
                        f"block {block.block_id} is freed {counts[block.block_id]} times "
                        f"but holds {block.ref_count} reference(s)"
                    )

    def _take(self, n: int) -> list[Block]:
        """Unreferenced blocks, empty first, then new, then evicted; all or nothing."""
        room = self.max_blocks - len(self._blocks)
        available = self._empty.size + room + self._lru.size + self._leased.size
        if n > available:
            raise OutOfBlocksError(n, available, self.max_blocks)
        out = [self._empty.popleft() for _ in range(min(n, self._empty.size))]
        grow = min(n - len(out), room)
        if grow:
            start = len(self._blocks)
            new = [Block(i) for i in range(start, start + grow)]
            self._blocks.extend(new)
            out.extend(new)
        for _ in range(n - len(out)):
            block = (self._lru if self._lru.size else self._leased).popleft()
            if self.on_evict is not None:
                self.on_evict(block, "capacity")
            self._uncache(block)
            self._evictions += 1
            out.append(block)
        return out

    def _uncache(self, block: Block) -> None:
        """Forget ``block``'s cached data (it stays in whatever queue it is in)."""
        assert block.block_hash is not None and block.parent_key is not None
        del self._cached[block.block_hash]
        siblings = self._children[block.parent_key]
        del siblings[block.block_id]
        if not siblings:
            del self._children[block.parent_key]
        block.block_hash = block.parent_key = block.token_ids = None
        block.serial = 0

    def evict_all(self) -> int:
        """Drop every unreferenced cached block's data (cache clear); returns how many."""
        with self._lock:
            count = self._lru.size + self._leased.size
            for queue in (self._lru, self._leased):
                while queue.size:
                    block = queue.popleft()
                    if self.on_evict is not None:
                        self.on_evict(block, "clear")
                    self._uncache(block)
                    self._empty.append(block)
            self._evictions += count
            return count

    # -- prefix cache ------------------------------------------------------------

    def match_prefix(
        self,
        token_ids: TokenIds,
        extra: ExtraKeys | None = None,
        *,
        chain: HashChain | None = None,
        acquire: bool = False,
    ) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``, verified token by token.

        Takes no references and leaves the eviction order alone, unless
        ``acquire=True``, which references the matched blocks atomically (a
        block matched without it may be evicted before a later ``acquire``).
        ``chain`` reuses a ``hasher.chain(token_ids, extra)`` computed earlier.
        """
        if chain is None:
            chain = self.hasher.chain(token_ids, extra)
        elif chain.num_tokens != len(token_ids):
            raise ValueError("chain was computed from other tokens than token_ids")
        bs, size = self.block_size, 4 * self.block_size
        buf, keys = chain.token_bytes, chain.parent_keys
        with self._lock:
            self._query_tokens += chain.num_tokens
            if not self.enable_caching:
                return PrefixMatch([], 0, [], chain)
            blocks, prev_serial = self._full_run(chain)
            k = len(blocks)
            num_tokens = k * bs
            child, common = self._best_child(keys[k], buf[k * size : (k + 1) * size], prev_serial)
            if child is not None:
                blocks.append(child)
                num_tokens += common
            self._hit_tokens += num_tokens
            if acquire:
                self._acquire(blocks)
            return PrefixMatch(blocks, num_tokens, chain.hashes[:k], chain)

    def _full_run(self, chain: HashChain) -> tuple[list[Block], int]:
        """The cached full blocks of `chain` from its start, and the last one's serial."""
        size, buf, keys = 4 * self.block_size, chain.token_bytes, chain.parent_keys
        blocks: list[Block] = []
        prev_serial = 0
        cached = self._cached
        for i, h in enumerate(chain.hashes):
            block = cached.get(h)
            if (
                block is None
                or block.serial <= prev_serial
                or block.parent_key != keys[i]
                or block.token_ids != buf[i * size : (i + 1) * size]
            ):
                break
            blocks.append(block)
            prev_serial = block.serial
        return blocks, prev_serial

    def peek_full_blocks(self, chain: HashChain) -> int:
        """How many full blocks of `chain` `match_prefix` would find: no references, no
        counters, the eviction order untouched (for explaining a lookup)."""
        with self._lock:
            if not self.enable_caching:
                return 0
            return len(self._full_run(chain)[0])

    def peek_children(self, parent_key: bytes) -> list[bytes]:
        """The token ids (int32-LE) of every cached child of `parent_key`, copied under
        the lock: the blocks may be reused by another thread once this returns."""
        with self._lock:
            return [b.token_ids for b in self._children.get(parent_key, {}).values() if b.token_ids]

    def _best_child(self, key: bytes, tail: bytes, prev_serial: int) -> tuple[Block | None, int]:
        """The child of ``key`` sharing the most leading tokens with ``tail``."""
        children = self._children.get(key)
        if not children or not tail:
            return None, 0
        first = tail[:4]
        best, best_common = None, 0
        for child in children.values():
            tokens = child.token_ids
            assert tokens is not None
            if not tokens.startswith(first) or child.serial <= prev_serial:
                continue
            common = _common_prefix(tokens, tail)
            if common > best_common:
                best, best_common = child, common
                if 4 * common == len(tail):
                    break
        return best, best_common

    def cache_blocks(
        self,
        blocks: Sequence[Block],
        token_ids: TokenIds,
        extra: ExtraKeys | None = None,
        *,
        chain: HashChain | None = None,
    ) -> int:
        """Register ``blocks[i]`` as holding tokens ``[i*bs, (i+1)*bs)``; returns how many.

        The last block, when partial, becomes a partial tail. Blocks already
        cached are skipped; a block whose hash another block holds stays
        uncached. Caching stops at a block that cannot be trusted: one
        carrying a different hash, or a hash collision. Blocks must be
        referenced (``ValueError``). ``chain`` reuses the hash chain of a
        sequence that starts with ``token_ids`` (it may run longer), so a
        request's tokens are hashed once however often it caches blocks.
        """
        if chain is None:
            chain = self.hasher.chain(token_ids, extra)
        elif chain.num_tokens < len(token_ids):
            raise ValueError(
                f"chain holds {chain.num_tokens} tokens, fewer than the {len(token_ids)} to cache"
            )
        if not self.enable_caching:
            return 0
        bs, size = self.block_size, 4 * self.block_size
        num_tokens = len(token_ids)
        buf = chain.token_bytes[: 4 * num_tokens]
        keys, hashes = chain.parent_keys, chain.hashes
        num_full = num_tokens // bs
        count = min(len(blocks), -(-num_tokens // bs))
        tail_hash = None
        if count > num_full:
            tail_hash = self.hasher.hash_block(keys[count - 1], buf[(count - 1) * size :])
        registered = 0
        with self._lock:
            self._validate(blocks[:count], held=True)
            prev_serial = 0
            for i in range(count):
                block = blocks[i]
                h = hashes[i] if i < num_full else tail_hash
                if block.block_hash == h and block.serial > prev_serial:
                    prev_serial = block.serial  # this request's block, cached before
                    continue
                assert h is not None
                key, tokens = keys[i], buf[i * size : (i + 1) * size]
                holder = self._cached.get(h)
                if holder is not None and (holder.parent_key != key or holder.token_ids != tokens):
                    break  # a collision: the holder names other tokens
                if holder is not None and holder.serial <= prev_serial:
                    # Registered before its parent's current registration, so its
                    # context is unknown: replace it rather than trust it.
                    self._uncache(holder)
                    self._evictions += 1
                    if holder.ref_count == 0:
                        self._cached_queue(holder).remove(holder)
                        self._empty.append(holder)
                    holder = None
                if holder is None:
                    if block.block_hash is not None:
                        break  # holds other cached tokens: read-only, never written here
                    self._serial += 1
                    block.block_hash, block.parent_key = h, key
                    block.token_ids, block.serial = tokens, self._serial
                    self._cached[h] = block
                    self._children.setdefault(key, {})[block.block_id] = block
                    holder = block
                    registered += 1
                elif block.block_hash is not None and block is not holder:
                    break
                prev_serial = holder.serial
        return registered

    # -- copy on write -----------------------------------------------------------

    def fork(self, table: BlockTable, new_id: Hashable) -> BlockTable:
        """A new table sharing every block of ``table`` (one more reference each)."""
        with self._lock:
            self._validate(table.blocks, held=True)
            self._acquire(table.blocks)
            return BlockTable(new_id, list(table.blocks))

    def make_writable(self, table: BlockTable, i: int, *, release_old: bool = True) -> Block:
        """Make ``table.blocks[i]`` safe to write into and return it.

        A block held only by this table and not cached is returned as is.
        Otherwise (shared, or cached and so read-only) a fresh block replaces
        it in the table and is returned; the pool moves no data, so the
        caller copies the KV it keeps from the old block (read
        ``old = table.blocks[i]`` before the call) into the new one. With
        ``release_old=True`` the table's reference to the old block is dropped
        here: a cached old block stays intact until evicted, but another
        thread may evict it; pass ``release_old=False`` to keep the reference
        until the copy is done, then ``free([old])``.
        """
        with self._lock:
            old = table.blocks[i]
            self._validate([old], held=True)
            if old.ref_count == 1 and old.block_hash is None:
                return old
            (new,) = self._take(1)
            new.ref_count = 1
            self._allocated += 1
            table.blocks[i] = new
            if release_old:
                self._release([old])
            self._cow_copies += 1
            return new

    # -- observability -------------------------------------------------------------

    def stats(self) -> PoolStats:
        with self._lock:
            q, hits = self._query_tokens, self._hit_tokens
            return PoolStats(
                num_blocks=len(self._blocks),
                max_blocks=self.max_blocks,
                allocated=self._allocated,
                free=len(self._blocks) - 1 - self._allocated,
                cached=len(self._cached),
                shared=self._shared,
                query_tokens=q,
                hit_tokens=hits,
                hit_rate=hits / q if q else 0.0,
                evictions=self._evictions,
                cow_copies=self._cow_copies,
            )

    def check(self) -> None:
        """Raise ``PoolInvariantError`` if any invariant is broken (scans the pool)."""
        with self._lock:
            check_pool(self)
