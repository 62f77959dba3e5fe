"""A bounded memory of cached blocks that lost their data, for explaining misses.

Each entry is one block's parent key, its token ids and its departure (when,
from which tier, why). Indexed by parent key, because a miss is explained at
the first block the lookup could not find, whose parent key is known: an
evicted child sharing more tokens with the prompt than anything still cached
means "evicted", any other known child means "diverged".

The token ids never leave this class: `agreement` answers how many leading
tokens the best-agreeing evicted child shares with the caller's own tokens, and
when that child left, nothing more (explain must never show one request another
request's tokens; see docs/security.md, "What explain shows to whom"). They
are kept because the agreement is counted token by token inside a block: a hash
per block answers only "all or nothing", and a hash per token prefix would cost
as much memory and hide nothing (each one can be matched by trying the
vocabulary).

Size: at most `max_blocks` entries (default 8192), oldest forgotten first. An
entry holds the block's tokens (4 bytes each) plus ~200 bytes of Python
objects: ~460 bytes at 64-token blocks, ~3.7 MiB for 8192 entries, which
remember the last 512K evicted tokens. Keys are salted hashes, so an entry can
only ever match a prompt of the tenant that made it.

Thread-safe: written by the engine's worker (from the pool's eviction hook,
under the pool's lock: O(1) per block), read by explain calls on other threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

DEFAULT_MAX_BLOCKS = 8192


@dataclass(frozen=True, slots=True)
class Departure:
    """How a block left: `reason` is "capacity" (evicted to make room) or "clear"."""

    when: float  # time.time()
    tier: str
    reason: str


@dataclass(frozen=True, slots=True)
class Agreement:
    """The evicted child of a parent key that shares the most leading tokens with the
    caller's block: how many (`num_tokens`, 0 when it differs at once) and its
    departure. Carries no token of the evicted block."""

    num_tokens: int
    departure: Departure


@dataclass(frozen=True, slots=True)
class _Evicted:
    parent_key: bytes
    token_ids: bytes  # int32-LE; private, see the module docstring
    departure: Departure


def common_prefix(theirs: bytes, ours: np.ndarray) -> int:
    """How many leading tokens `theirs` (int32-LE bytes) shares with `ours`."""
    other = np.frombuffer(theirs, dtype="<i4")
    n = min(len(other), len(ours))
    diff = np.flatnonzero(other[:n] != ours[:n])
    return int(diff[0]) if len(diff) else n


class CacheHistory:
    """See the module docstring."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Evicted] = OrderedDict()
        self._by_parent: dict[bytes, dict[int, _Evicted]] = {}
        self._next = 0
        self.cleared_at: float | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, parent_key: bytes, token_ids: bytes, tier: str, reason: str) -> None:
        entry = _Evicted(parent_key, token_ids, Departure(time.time(), tier, reason))
        with self._lock:
            key, self._next = self._next, self._next + 1
            self._entries[key] = entry
            self._by_parent.setdefault(parent_key, {})[key] = entry
            while len(self._entries) > self.max_blocks:
                old_key, old = self._entries.popitem(last=False)
                siblings = self._by_parent[old.parent_key]
                del siblings[old_key]
                if not siblings:
                    del self._by_parent[old.parent_key]

    def cleared(self) -> None:
        """Every tier was cleared now: blocks that had only left RAM before are gone too."""
        self.cleared_at = time.time()

    def agreement(self, parent_key: bytes, ours: np.ndarray) -> Agreement | None:
        """Of the evicted children of `parent_key`, the one sharing the most leading
        tokens with `ours` (the newest on a tie); None when there is none."""
        with self._lock:
            children = list(self._by_parent.get(parent_key, {}).values())
        best: Agreement | None = None
        for entry in reversed(children):  # newest first
            n = common_prefix(entry.token_ids, ours)
            if best is None or n > best.num_tokens:
                best = Agreement(n, entry.departure)
        return best
