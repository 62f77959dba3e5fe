"""Leases: a client's promise to come back to a prefix, kept by evicting it last.

A lease covers the full blocks of one prefix (their hashes) for a time to live;
every hit on the prefix renews it. While it runs the pool evicts the blocks
after every unleased block (`BlockPool.pin`), and the lower tiers that are told
(`KVTier.lease`) keep them past their own LRU order. When it lapses (its time
ran out, the admin dropped it, or newer leases needed the room) the blocks go
back to the ordinary eviction order; nothing is evicted at that moment.

Invariants (`check()` verifies them):
- The hashes the pool holds as leased are exactly the union of the live leases'
  hashes, and there are at most `max_blocks` of them (the fraction of the RAM
  tier `max_leased_fraction` allows): a grant that would pass it lapses the
  least recently renewed leases first, and a lease longer than the whole
  allowance covers only its first `max_blocks` blocks.
- Every public method lapses the expired leases first, so an expired lease
  never outlives the next call.

Tenants: a lease belongs to the `tenant` that asked for it (the server passes
the API key's salt). Its hashes are salted by the tenant's cache salt, so a hit
by another tenant can never renew it; `list` and `drop` are for the admin.

Hashes of lapsed leases are remembered (bounded, oldest forgotten first), so
that a block evicted after its lease lapsed can be explained as
`lease_expired`. `lapsed_at` is read without the lock, under the pool's lock
(the eviction hook): one dict lookup, atomic in CPython; taking this table's
lock there would invert the order `grant` takes them in.

Thread-safe: one lock; the pool's lock is taken inside it, never around it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.cache.pool import BlockPool

DEFAULT_MAX_LEASED_FRACTION = 0.5
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0, "24h": 86400.0}
_LAPSED_MEMORY = 8192  # lapsed hashes remembered for explain


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """What a request asks for: its first `num_tokens` prompt tokens kept `ttl_s`
    seconds; `ram_only`: the lower tiers are not told (OpenAI's "in_memory")."""

    num_tokens: int
    ttl_s: float
    ram_only: bool = False
    label: str = "-"  # who asked, as the admin's list shows it (never the tenant's salt)
    group: str | None = None  # OpenAI's prompt_cache_key, shown in the list


@dataclass(slots=True)
class Lease:
    lease_id: str
    tenant: str | None
    hashes: tuple[bytes, ...]
    num_tokens: int
    ttl_s: float
    ram_only: bool
    created: float
    expires: float
    label: str = "-"
    group: str | None = None
    renewals: int = 0

    def to_json(self, now: float) -> dict[str, object]:
        """What the admin sees: the tenant's label, never its salt."""
        return {
            "id": self.lease_id,
            "tenant": self.label,
            "prompt_cache_key": self.group,
            "num_blocks": len(self.hashes),
            "num_tokens": self.num_tokens,
            "ttl_s": self.ttl_s,
            "tiers": ["ram"] if self.ram_only else ["ram", "ssd", "redis"],
            "created": self.created,
            "expires_in_s": round(max(0.0, self.expires - now), 3),
            "renewals": self.renewals,
        }


# Told of each lease's hashes once as it starts and once as it lapses (the lower tiers;
# renewals are not told: a tier keeps a leased block until the lease lapses).
LeaseHook = Callable[[Sequence[bytes], float], None]


class LeaseTable:
    """See the module docstring."""

    def __init__(
        self,
        pool: BlockPool,
        max_leased_fraction: float = DEFAULT_MAX_LEASED_FRACTION,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0.0 <= max_leased_fraction <= 1.0:
            raise ValueError(f"max_leased_fraction must be in [0, 1], got {max_leased_fraction!r}")
        self.pool = pool
        self.max_leased_fraction = max_leased_fraction
        self.max_blocks = int(max_leased_fraction * (pool.max_blocks - 1))
        self.clock = clock
        self._lock = threading.Lock()
        self._leases: OrderedDict[str, Lease] = OrderedDict()  # least recently renewed first
        self._by_end: dict[tuple[str | None, bytes], str] = {}  # (tenant, last hash) -> id
        self._by_hash: dict[bytes, set[str]] = {}  # last hash -> ids, for renew on hit
        self._expiry: list[tuple[float, int, str]] = []  # heap; stale entries skipped
        self._tie = itertools.count()
        self._lapsed: OrderedDict[bytes, float] = OrderedDict()
        self.on_grant: LeaseHook | None = None
        self.on_lapse: LeaseHook | None = None
        self.lapsed_count = 0

    def __len__(self) -> int:
        return len(self._leases)

    # -- granting and renewing ----------------------------------------------------

    def grant(
        self, tenant: str | None, hashes: Sequence[bytes], num_tokens: int, request: LeaseRequest
    ) -> Lease | None:
        """Lease `hashes` (a prefix's full blocks) for `request.ttl_s`; the tenant's lease
        on the same prefix is renewed instead (its TTL becomes the longer of the two).
        None when nothing can be leased (no full block, or a zero allowance)."""
        hashes = tuple(hashes[: self.max_blocks])
        if not hashes:
            return None
        num_tokens = min(num_tokens, len(hashes) * self.pool.block_size)
        with self._lock:
            now = self.clock()
            self._expire(now)
            lease_id = self._by_end.get((tenant, hashes[-1]))
            if lease_id is not None:
                lease = self._leases[lease_id]
                lease.ttl_s = max(lease.ttl_s, request.ttl_s)
                if lease.ram_only and not request.ram_only:  # now on every tier
                    lease.ram_only = False
                    if self.on_grant is not None:
                        self.on_grant(lease.hashes, lease.ttl_s)
                self._renew(lease, now)
                return lease
            lease = Lease(
                "lease_" + uuid.uuid4().hex[:24], tenant, hashes, num_tokens, request.ttl_s,
                request.ram_only, now, now + request.ttl_s, request.label, request.group,
            )  # fmt: skip
            self.pool.pin(hashes)
            while self.pool.num_leased_hashes > self.max_blocks:
                oldest = next(iter(self._leases.values()))
                self._lapse(oldest, now)
            self._leases[lease.lease_id] = lease
            self._by_end[(tenant, hashes[-1])] = lease.lease_id
            self._by_hash.setdefault(hashes[-1], set()).add(lease.lease_id)
            heapq.heappush(self._expiry, (lease.expires, next(self._tie), lease.lease_id))
            if self.on_grant is not None and not lease.ram_only:
                self.on_grant(hashes, lease.ttl_s)
            return lease

    def renew_hits(self, hashes: Sequence[bytes]) -> int:
        """Renew every lease whose prefix `hashes` (a request's matched full blocks, in
        order) covers; returns how many. The hashes are salted per tenant, so only the
        tenant's own requests can renew its leases."""
        if not self._leases:
            return 0
        renewed = 0
        with self._lock:
            now = self.clock()
            self._expire(now)
            for h in hashes:
                for lease_id in self._by_hash.get(h, ()):
                    self._renew(self._leases[lease_id], now)
                    renewed += 1
        return renewed

    def _renew(self, lease: Lease, now: float) -> None:
        lease.expires = now + lease.ttl_s
        lease.renewals += 1
        self._leases.move_to_end(lease.lease_id)
        heapq.heappush(self._expiry, (lease.expires, next(self._tie), lease.lease_id))

    # -- lapsing ------------------------------------------------------------------

    def expire(self) -> int:
        """Lapse every lease whose time ran out; returns how many."""
        if not self._expiry:
            return 0
        with self._lock:
            return self._expire(self.clock())

    def _expire(self, now: float) -> int:
        count = 0
        heap = self._expiry
        while heap and heap[0][0] <= now:
            expires, _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires == expires:
                self._lapse(lease, now)
                count += 1
        return count

    def _lapse(self, lease: Lease, now: float) -> None:
        del self._leases[lease.lease_id]
        last = lease.hashes[-1]
        del self._by_end[(lease.tenant, last)]
        ids = self._by_hash[last]
        ids.discard(lease.lease_id)
        if not ids:
            del self._by_hash[last]
        self.pool.unpin(lease.hashes)
        for h in lease.hashes:
            if not self.pool.is_leased(h):
                self._lapsed[h] = now
                self._lapsed.move_to_end(h)
        while len(self._lapsed) > _LAPSED_MEMORY:
            self._lapsed.popitem(last=False)
        self.lapsed_count += 1
        if self.on_lapse is not None and not lease.ram_only:
            self.on_lapse(lease.hashes, 0.0)

    def lapsed_at(self, block_hash: bytes) -> float | None:
        """When the last lease covering `block_hash` lapsed, if it is remembered and no
        lease covers it again. Lock-free (see the module docstring)."""
        when = self._lapsed.get(block_hash)
        if when is None or self.pool.is_leased(block_hash):
            return None
        return when

    # -- the admin's view ---------------------------------------------------------

    def list(self, tenant: str | None = None, *, all_tenants: bool = True) -> list[Lease]:
        """Live leases, least recently renewed first; of `tenant` only unless
        `all_tenants`."""
        with self._lock:
            self._expire(self.clock())
            return [
                lease for lease in self._leases.values() if all_tenants or lease.tenant == tenant
            ]

    def drop(self, lease_id: str) -> bool:
        """Lapse one lease now; False when no live lease has that id."""
        with self._lock:
            now = self.clock()
            self._expire(now)
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            self._lapse(lease, now)
            return True

    def drop_all(self) -> int:
        with self._lock:
            now = self.clock()
            count = len(self._leases)
            for lease in list(self._leases.values()):
                self._lapse(lease, now)
            return count

    def check(self) -> None:
        """Raise AssertionError when an invariant of the module docstring is broken."""
        with self._lock:
            counts: dict[bytes, int] = {}
            for lease in self._leases.values():
                for h in lease.hashes:
                    counts[h] = counts.get(h, 0) + 1
            assert counts == self.pool._lease_counts, "pool's leased hashes != live leases'"
            assert len(counts) <= self.max_blocks, (
                f"{len(counts)} leased blocks over the allowance {self.max_blocks}"
            )
