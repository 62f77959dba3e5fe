"""Why a prompt would (not) hit the cache: the lookup of `RequestCache.restore_into`,
read-only, and the cause of the first token it would recompute.

Runs on any thread, never on the worker: the pool is read under its own lock
(`peek_full_blocks`, `peek_children` copy what they report, take no reference
and leave the eviction order and the hit counters alone), the lower tiers are
asked `contains` and `children` (metadata only; SSD keeps a connection per
thread, Redis clients are thread-safe) and the history has its own lock.
Rejected: routing it through the worker's queue, which waits for the step in
progress (a long prefill holds it for seconds) and so would miss the 50 ms
target under load; the price is that a block evicted while explain runs may
still be counted, which a request sent a moment later would also find missing.

Lower tiers answer from their index (`contains`): a block whose file turns out
corrupt is a miss for the request that reads it, which explain cannot foresee.

What comes out is positions, counts and reasons: the children's tokens (RAM,
lower tiers, history) are compared with the caller's own tokens here and only
the lengths of agreement are kept, so no token of another request can reach an
answer or a log line (docs/security.md, "What explain shows to whom").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from pagedkv.cache.hashing import HashChain
from pagedkv.cache.history import CacheHistory, Departure, common_prefix
from pagedkv.cache.pool import BlockPool
from pagedkv.cache.tiers import LowerTiers

Reason = Literal["new", "diverged", "evicted", "lease_expired"]
TIER_NAMES = ("ram", "ssd", "redis")


@dataclass(frozen=True, slots=True)
class MissCause:
    """The first token a request would recompute, and why: `departure` says when and
    how the evicted prefix left; `lower_tiers` names the tiers that were asked too.
    Holds no token of any prompt but the caller's (only its index)."""

    token_index: int
    reason: Reason
    departure: Departure | None = None
    lower_tiers: tuple[str, ...] = ()
    cleared_at: float | None = None


@dataclass(frozen=True, slots=True)
class PrefixExplanation:
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]
    miss: MissCause | None


def explain_lookup(
    pool: BlockPool, lower: LowerTiers, history: CacheHistory, chain: HashChain
) -> PrefixExplanation:
    bs = pool.block_size
    tokens = np.asarray(chain.tokens, dtype=np.int32)
    num_prompt = chain.num_tokens
    tiers = dict.fromkeys(TIER_NAMES, 0)
    k_ram = pool.peek_full_blocks(chain)
    run: list[str] = []  # tier of each full block found below RAM, in order
    if lower and k_ram < len(chain.hashes):
        wanted = chain.hashes[k_ram:]
        owner: list[str | None] = [None] * len(wanted)
        for tier in lower.tiers:
            todo = [i for i, o in enumerate(owner) if o is None]
            if not todo:
                break
            for i, present in zip(todo, tier.contains([wanted[i] for i in todo]), strict=True):
                if present:
                    owner[i] = tier.name
        for o in owner:
            if o is None:
                break
            run.append(o)
    num_full = k_ram + len(run)
    rest = tokens[num_full * bs : (num_full + 1) * bs]
    key = chain.parent_keys[num_full]
    partial, partial_tier = 0, "ram"
    any_live = False  # a child of `key` is cached in some tier (its tokens are not kept)
    if len(rest):
        if not run:  # like restore_into: a RAM partial only right after the RAM run
            live = pool.peek_children(key)
            any_live = bool(live)
            partial = max((common_prefix(t, rest) for t in live), default=0)
        if lower and partial == 0:
            for tier in lower.tiers:
                for meta in tier.children(key):
                    any_live = True
                    n = common_prefix(meta.token_ids.astype("<i4").tobytes(), rest)
                    if n > partial:
                        partial, partial_tier = n, tier.name
    matched = num_full * bs + partial
    cached = min(matched, num_prompt - 1)
    left = cached
    for tier_name in ["ram"] * k_ram + run:
        take = min(bs, left)
        tiers[tier_name] += take
        left -= take
    tiers[partial_tier] += max(0, left)
    if matched >= num_prompt - 1:
        return PrefixExplanation(num_prompt, cached, tiers, None)
    names = tuple(t.name for t in lower.tiers)
    miss = _cause(history, key, rest, partial, matched, any_live, names)
    return PrefixExplanation(num_prompt, cached, tiers, miss)


def _cause(
    history: CacheHistory,
    key: bytes,
    rest: np.ndarray,
    offset: int,
    index: int,
    any_live: bool,
    lower_names: tuple[str, ...],
) -> MissCause:
    """The miss at token `index`, `offset` tokens into the block whose parent is `key`:
    evicted when a departed child agreed with `rest` past `offset`, diverged when any
    child is known, new otherwise."""
    gone = history.agreement(key, rest)
    if gone is not None and gone.num_tokens > offset:
        dep = gone.departure
        cleared = history.cleared_at
        cleared_after = cleared if cleared is not None and cleared >= dep.when else None
        reason: Reason = "lease_expired" if dep.reason == "lease_expired" else "evicted"
        return MissCause(index, reason, dep, lower_names, cleared_after)
    if any_live or gone is not None:
        return MissCause(index, "diverged", None, lower_names)
    return MissCause(index, "new", None, lower_names)
