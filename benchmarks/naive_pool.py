"""The straightforward block pool that `bench_pool.py` measures pagedkv against.

The same rules as `pagedkv.BlockPool` (allocation and eviction order, verified
hits, partial tails, longest-common-prefix children, registration serials), so a
trace gets the same blocks and the same hits from both; written the obvious
way: a dataclass per block, each block's hash the sha256 of the string of a
`(parent, tuple(tokens))` tuple recomputed on every lookup, token lists compared
in Python, insertion-ordered dicts as queues. Only for benchmarks and tests.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass
class NaiveBlock:
    block_id: int
    ref_count: int = 0
    block_hash: str | None = None
    parent_key: str | None = None
    token_ids: list[int] = field(default_factory=list)
    serial: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class NaiveMatch:
    blocks: list[NaiveBlock]
    num_tokens: int
    num_full_blocks: int


class NaivePool:
    def __init__(self, block_size: int, max_blocks: int, initial_blocks: int | None = None):
        self.block_size = block_size
        self.max_blocks = max_blocks
        initial = min(256, max_blocks) if initial_blocks is None else initial_blocks
        self.blocks = [NaiveBlock(i) for i in range(initial)]
        self.empty = {b.block_id: b for b in self.blocks[1:]}
        self.lru: dict[int, NaiveBlock] = {}
        self.cached: dict[str, NaiveBlock] = {}
        self.children: dict[str, dict[int, NaiveBlock]] = {}
        self.serial = 0
        self.query_tokens = self.hit_tokens = self.evictions = 0

    def block_hash(self, parent: str, tokens: list[int]) -> str:
        return hashlib.sha256(str((parent, tuple(tokens))).encode()).hexdigest()

    def hashes(self, tokens: list[int]) -> list[str]:
        bs, parent, out = self.block_size, "root", []
        for i in range(len(tokens) // bs):
            parent = self.block_hash(parent, tokens[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def allocate(self, n: int) -> list[NaiveBlock]:
        room = self.max_blocks - len(self.blocks)
        if n > len(self.empty) + len(self.lru) + room:
            raise MemoryError(f"asked for {n} blocks")
        out = []
        while len(out) < n and self.empty:
            out.append(self.empty.pop(next(iter(self.empty))))
        while len(out) < n and len(self.blocks) < self.max_blocks:
            block = NaiveBlock(len(self.blocks))
            self.blocks.append(block)
            out.append(block)
        while len(out) < n:
            block = self.lru.pop(next(iter(self.lru)))
            self.uncache(block)
            self.evictions += 1
            out.append(block)
        for block in out:
            block.ref_count = 1
        return out

    def uncache(self, block: NaiveBlock) -> None:
        assert block.block_hash is not None and block.parent_key is not None
        del self.cached[block.block_hash]
        del self.children[block.parent_key][block.block_id]
        if not self.children[block.parent_key]:
            del self.children[block.parent_key]
        block.block_hash = block.parent_key = None
        block.token_ids = []
        block.serial = 0

    def free(self, blocks: list[NaiveBlock]) -> None:
        for block in blocks:
            if self.blocks[block.block_id] is not block or block.ref_count <= 0:
                raise ValueError(f"bad free of block {block.block_id}")
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                queue = self.empty if block.block_hash is None else self.lru
                queue[block.block_id] = block

    def acquire(self, blocks: list[NaiveBlock]) -> None:
        for block in blocks:
            if block.ref_count == 0:
                del self.lru[block.block_id]
            block.ref_count += 1

    def match_prefix(self, tokens: list[int]) -> NaiveMatch:
        bs = self.block_size
        self.query_tokens += len(tokens)
        matched: list[NaiveBlock] = []
        parent, last = "root", 0
        for i, h in enumerate(self.hashes(tokens)):
            block = self.cached.get(h)
            if (
                block is None
                or block.serial <= last
                or block.parent_key != parent
                or block.token_ids != tokens[i * bs : (i + 1) * bs]
            ):
                break
            matched.append(block)
            parent, last = h, block.serial
        k = len(matched)
        tail = tokens[k * bs : (k + 1) * bs]
        best, best_common = None, 0
        for child in self.children.get(parent, {}).values() if tail else ():
            common = 0
            limit = min(len(tail), len(child.token_ids))
            while common < limit and child.token_ids[common] == tail[common]:
                common += 1
            if child.serial > last and common > best_common:
                best, best_common = child, common
        if best is not None:
            matched.append(best)
        self.hit_tokens += k * bs + best_common
        return NaiveMatch(matched, k * bs + best_common, k)

    def cache_blocks(self, blocks: list[NaiveBlock], tokens: list[int]) -> int:
        bs = self.block_size
        hashes = self.hashes(tokens)
        parent, last, registered = "root", 0, 0
        for i in range(min(len(blocks), -(-len(tokens) // bs))):
            block, chunk = blocks[i], tokens[i * bs : (i + 1) * bs]
            h = hashes[i] if i < len(hashes) else self.block_hash(parent, chunk)
            holder = self.cached.get(h)
            if holder is not None and (holder.parent_key != parent or holder.token_ids != chunk):
                break
            if holder is not None and holder.serial <= last:
                self.uncache(holder)
                self.evictions += 1
                if holder.ref_count == 0:
                    del self.lru[holder.block_id]
                    self.empty[holder.block_id] = holder
                holder = None
            if holder is None:
                if block.block_hash is not None:
                    break
                self.serial += 1
                block.block_hash, block.parent_key = h, parent
                block.token_ids, block.serial = list(chunk), self.serial
                self.cached[h] = block
                self.children.setdefault(parent, {})[block.block_id] = block
                holder, registered = block, registered + 1
            elif block.block_hash is not None and block is not holder:
                break
            parent, last = h, holder.serial
        return registered
