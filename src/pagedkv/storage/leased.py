"""The hashes a lower tier keeps past its LRU order because a lease covers them.

Counts, not a set: two leases may cover one block, and each `release` undoes
one `add`. `snapshot()` is what an eviction reads: a frozenset swapped in whole
on every change, so the writer thread reads it without the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class LeasedHashes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[bytes, int] = {}
        self._frozen: frozenset[bytes] = frozenset()
        self.max_fraction = 0.5

    def add(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            for h in hashes:
                self._counts[h] = self._counts.get(h, 0) + 1
            self._frozen = frozenset(self._counts)

    def release(self, hashes: Sequence[bytes]) -> None:
        with self._lock:
            for h in hashes:
                n = self._counts.get(h, 0)
                if n > 1:
                    self._counts[h] = n - 1
                elif n == 1:
                    del self._counts[h]
            self._frozen = frozenset(self._counts)

    def snapshot(self) -> frozenset[bytes]:
        return self._frozen

    def __len__(self) -> int:
        return len(self._frozen)
