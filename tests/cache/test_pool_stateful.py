"""Random operation sequences against a plain reference model, with check() after each.

The model names cached data by content (salt and the whole token prefix up to a
block's end) and keeps every queue as a Python list; it encodes the rules the
pool's hash chain, free queues and counters must implement.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.pool import BlockPool, BlockTable
from pagedkv.errors import OutOfBlocksError

BS, MAX_BLOCKS, INITIAL = 2, 9, 4
Content = tuple[str | None, tuple[int, ...]]


class Model:
    def __init__(self) -> None:
        self.num_blocks = INITIAL
        self.ref = dict.fromkeys(range(1, INITIAL), 0)
        self.empty = list(range(1, INITIAL))
        self.lru: list[int] = []
        self.content: dict[int, Content] = {}
        self.serial: dict[int, int] = {}
        self.last_serial = 0
        self.query = self.hits = self.evictions = self.cow = 0

    def holder(self, content: Content) -> int | None:
        return next((b for b, c in self.content.items() if c == content), None)

    def available(self) -> int:
        return len(self.empty) + len(self.lru) + MAX_BLOCKS - self.num_blocks

    def take(self, n: int) -> list[int] | None:
        if n > self.available():
            return None
        out = [self.empty.pop(0) for _ in range(min(n, len(self.empty)))]
        while len(out) < n and self.num_blocks < MAX_BLOCKS:
            out.append(self.num_blocks)
            self.num_blocks += 1
        while len(out) < n:
            block = self.lru.pop(0)
            self.uncache(block)
            out.append(block)
        for block in out:
            self.ref[block] = 1
        return out

    def uncache(self, block: int) -> None:
        del self.content[block], self.serial[block]
        self.evictions += 1

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                (self.lru if block in self.content else self.empty).append(block)

    def acquire(self, blocks: list[int]) -> None:
        for block in blocks:
            if self.ref[block] == 0:
                self.lru.remove(block)
            self.ref[block] += 1

    def match(self, tokens: list[int], salt: str | None) -> tuple[list[int], int]:
        self.query += len(tokens)
        full: list[int] = []
        last = 0
        for i in range(len(tokens) // BS):
            block = self.holder((salt, tuple(tokens[: (i + 1) * BS])))
            if block is None or self.serial[block] <= last:
                break
            full.append(block)
            last = self.serial[block]
        k = len(full)
        head, tail = tuple(tokens[: k * BS]), tokens[k * BS : (k + 1) * BS]
        best, best_common = None, 0
        for block in sorted(self.content, key=self.serial.__getitem__):
            s, c = self.content[block]
            if s != salt or not k * BS < len(c) <= (k + 1) * BS or c[: k * BS] != head:
                continue
            common = 0
            while common < min(len(tail), len(c) - k * BS) and c[k * BS + common] == tail[common]:
                common += 1
            if self.serial[block] > last and common > best_common:
                best, best_common = block, common
        matched = full + ([best] if best is not None else [])
        self.hits += k * BS + best_common
        return matched, k * BS + best_common

    def cache(self, blocks: list[int], tokens: list[int], salt: str | None) -> int:
        registered, last = 0, 0
        for i in range(min(len(blocks), -(-len(tokens) // BS))):
            block, content = blocks[i], (salt, tuple(tokens[: (i + 1) * BS]))
            holder = self.holder(content)
            if holder is not None and self.serial[holder] <= last:
                self.uncache(holder)
                if self.ref[holder] == 0:
                    self.lru.remove(holder)
                    self.empty.append(holder)
                holder = None
            if holder is None:
                if block in self.content:
                    break
                self.last_serial += 1
                self.content[block], self.serial[block] = content, self.last_serial
                holder, registered = block, registered + 1
            elif block in self.content and block != holder:
                break
            last = self.serial[holder]
        return registered


@dataclass
class Seq:
    table: BlockTable
    ids: list[int]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        hasher = BlockHasher(block_size=BS, seed=b"stateful")
        self.pool = BlockPool(BS, MAX_BLOCKS, INITIAL, hasher=hasher)
        self.model = Model()
        self.live: list[Seq] = []
        self.next_id = 0

    def _new_seq(self, blocks: list, ids: list[int]) -> None:  # type: ignore[type-arg]
        assert [b.block_id for b in blocks] == ids
        self.next_id += 1
        self.live.append(Seq(BlockTable(self.next_id, blocks), list(ids)))

    @rule(tokens=st.lists(st.integers(1, 3), max_size=9), salt=st.sampled_from([None, "s"]))
    def request(self, tokens: list[int], salt: str | None) -> None:
        extra = ExtraKeys(cache_salt=salt) if salt else None
        match = self.pool.match_prefix(tokens, extra)
        want, want_tokens = self.model.match(tokens, salt)
        assert [b.block_id for b in match.blocks] == want
        assert match.num_tokens == want_tokens
        full = match.blocks[: match.num_full_blocks]
        self.pool.acquire(full)
        self.model.acquire(want[: len(full)])
        need = -(-len(tokens) // BS) - len(full)
        new_ids = self.model.take(need)
        try:
            new = self.pool.allocate(need)
        except OutOfBlocksError:
            assert new_ids is None
            self.pool.free(full)
            self.model.release(want[: len(full)])
            return
        assert new_ids is not None
        blocks = full + new
        ids = want[: len(full)] + new_ids
        assert self.pool.cache_blocks(blocks, tokens, extra) == self.model.cache(ids, tokens, salt)
        self._new_seq(blocks, ids)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick: int) -> None:
        seq = self.live.pop(pick % len(self.live))
        self.pool.free(seq.table.blocks)
        self.model.release(seq.ids)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 100))
    def fork(self, pick: int) -> None:
        seq = self.live[pick % len(self.live)]
        child = self.pool.fork(seq.table, "fork")
        self.model.acquire(seq.ids)
        self._new_seq(child.blocks, seq.ids)

    @precondition(lambda self: any(s.ids for s in self.live))
    @rule(pick=st.integers(0, 100), index=st.integers(0, 10))
    def write(self, pick: int, index: int) -> None:
        seq = [s for s in self.live if s.ids][pick % len([s for s in self.live if s.ids])]
        i = index % len(seq.ids)
        old, model = seq.ids[i], self.model
        if model.ref[old] == 1 and old not in model.content:
            assert self.pool.make_writable(seq.table, i).block_id == old
            return
        new_ids = model.take(1)
        try:
            new = self.pool.make_writable(seq.table, i)
        except OutOfBlocksError:
            assert new_ids is None
            return
        assert new_ids == [new.block_id]
        seq.ids[i] = new.block_id
        model.release([old])
        model.cow += 1

    @rule(n=st.integers(0, 3))
    def allocate_raw(self, n: int) -> None:
        ids = self.model.take(n)
        try:
            blocks = self.pool.allocate(n)
        except OutOfBlocksError:
            assert ids is None
            return
        assert ids is not None
        self._new_seq(blocks, ids)

    @rule()
    def clear(self) -> None:
        dropped = list(self.model.lru)
        for block in dropped:
            self.model.uncache(block)
        self.model.empty += dropped
        self.model.lru = []
        assert self.pool.evict_all() == len(dropped)

    @invariant()
    def consistent(self) -> None:
        self.pool.check()
        m = self.model
        allocated = sum(r > 0 for r in m.ref.values())
        stats = self.pool.stats()
        assert (stats.num_blocks, stats.allocated, stats.free) == (
            m.num_blocks,
            allocated,
            m.num_blocks - 1 - allocated,
        )
        assert stats.shared == sum(r > 1 for r in m.ref.values())
        assert stats.cached == len(m.content)
        assert (stats.query_tokens, stats.hit_tokens) == (m.query, m.hits)
        assert (stats.evictions, stats.cow_copies) == (m.evictions, m.cow)
        for block_id, ref in m.ref.items():
            assert self.pool._blocks[block_id].ref_count == ref


PoolMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, derandomize=True
)
TestPoolMachine = PoolMachine.TestCase
