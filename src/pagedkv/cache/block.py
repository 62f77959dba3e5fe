"""Block metadata and the intrusive doubly linked queue of free blocks.

The links live in the blocks themselves (``prev_free``/``next_free``), around
one sentinel, so appending, popping the front and unlinking a block from the
middle are all O(1) and allocate nothing. ``collections.deque`` was rejected:
reviving a cached block from the middle of the queue would be
``deque.remove``, O(n) in the pool size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Block", "FreeBlockQueue"]


@dataclass(slots=True, eq=False, repr=False)
class Block:
    """One KV block's metadata; compared by identity.

    Cached blocks (``block_hash`` set) are immutable: their first
    ``num_tokens`` KV slots are what the hash names, so nobody may write into
    them (see ``BlockPool.make_writable``). ``parent_key`` is the parent key
    the hash was computed from and ``token_ids`` the int32-LE tokens; a hit is
    verified against both. ``serial`` numbers registrations, so a block can
    tell whether its parent's current registration predates it (0: uncached).
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    parent_key: bytes | None = None
    token_ids: bytes | None = None
    serial: int = 0
    prev_free: Block | None = None
    next_free: Block | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the cached block holds; 0 while uncached."""
        return len(self.token_ids) >> 2 if self.token_ids is not None else 0

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return (
            f"Block(id={self.block_id}, ref={self.ref_count}, hash={h}, "
            f"num_tokens={self.num_tokens})"
        )


class FreeBlockQueue:
    """Blocks in the order they will be handed out: the front goes first.

    Invariants: a block is linked (``prev_free``/``next_free`` not None) iff it
    is in exactly one queue; ``size`` is the number of linked blocks; following
    ``next_free`` from the sentinel visits every block once and returns to it.
    """

    __slots__ = ("sentinel", "size")

    def __init__(self, sentinel: Block) -> None:
        sentinel.prev_free = sentinel.next_free = sentinel
        self.sentinel = sentinel
        self.size = 0

    def append(self, block: Block) -> None:
        """Put ``block`` at the back: it will be handed out last."""
        s = self.sentinel
        last = s.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = s
        s.prev_free = block
        self.size += 1

    def popleft(self) -> Block:
        """Unlink and return the front block; the caller checks ``size`` first."""
        block = self.sentinel.next_free
        assert block is not None and block is not self.sentinel, "pop from an empty free queue"
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from wherever it is in this queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not queued"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.size -= 1

    def __iter__(self) -> Iterator[Block]:
        """Front to back; for checks and tests, not for hot paths."""
        s = self.sentinel
        block = s.next_free
        while block is not s and block is not None:
            yield block
            block = block.next_free
