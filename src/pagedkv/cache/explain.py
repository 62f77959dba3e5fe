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

The answer's `cached_tokens` is what the restore would give, for every model kind:
the same cuts are made, from indexes only: a model with recurrent layers stops at
the last block boundary with a state snapshot (`SnapshotStore.peek`): KV cached
past it is `below_block` when it is less than a block past that boundary,
`snapshot_missing` otherwise; a model whose sliding layers' KV is stored apart
stops before a lower-tier block whose window part no tier has (`evicted`). A
`new` miss at a block an image starts in, where the cache holds the same tokens
under another image's key (`cache.segments`), is `image_changed`. A
`new` or `diverged` miss is then looked for under other roots
(`cache.elsewhere`): another namespace (`identity_changed`), another tenant's
salt when the caller may be told (`other_tenant`). The server turns some into
`template_drift` (`server/drift.py`); the lease and reasoning-aware storing code
name `lease_expired` and `reasoning_stripped`.

What comes out is positions, counts and reasons: the children's tokens (RAM,
lower tiers, history) are compared with the caller's own tokens here and only
the lengths of agreement are kept, so no token of another request can reach an
answer or a log line (docs/security.md, "What explain shows to whom").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from pagedkv.cache.elsewhere import IdentityChange, identity_change, other_tenant_holds
from pagedkv.cache.hashing import ExtraKeys, HashChain
from pagedkv.cache.history import CacheHistory, Departure, common_prefix
from pagedkv.cache.pool import BlockPool
from pagedkv.cache.segments import ImageHistory, changed_image
from pagedkv.cache.snapshots import SnapshotStore
from pagedkv.cache.split import WindowSplit
from pagedkv.cache.tiers import LowerTiers

# Every cause a miss can have; docs/usage.md ("Why a prompt misses") explains each.
# `lease_expired` and `reasoning_stripped` are produced by the lease and the
# reasoning-aware storing code, `template_drift` by the server (`server/drift.py`).
Reason = Literal[
    "new",
    "diverged",
    "below_block",
    "evicted",
    "lease_expired",
    "other_tenant",
    "identity_changed",
    "template_drift",
    "reasoning_stripped",
    "snapshot_missing",
    "image_changed",
]
REASONS: tuple[Reason, ...] = get_args(Reason)
TIER_NAMES = ("ram", "ssd", "redis")


@dataclass(frozen=True, slots=True)
class MissCause:
    """The first token a request would recompute, and why: `departure` says when and
    how the evicted prefix left; `lower_tiers` names the tiers that were asked too;
    `shared_tokens` (below_block, snapshot_missing) how many tokens the cache holds
    KV for, past `token_index`'s recomputed ones; `identity` (identity_changed) where
    the prefix is under another namespace. Holds no token of any prompt but the
    caller's (only its index)."""

    token_index: int
    reason: Reason
    departure: Departure | None = None
    lower_tiers: tuple[str, ...] = ()
    cleared_at: float | None = None
    shared_tokens: int = 0
    identity: IdentityChange | None = None
    # image_changed: the index of the caller's image that differs from the cached one.
    image_index: int | None = None


@dataclass(frozen=True, slots=True)
class PrefixExplanation:
    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]
    miss: MissCause | None


@dataclass(frozen=True, slots=True)
class LookupParts:
    """What besides the pool and tiers decides a restore: the model's recurrent-state
    snapshots and its sliding layers' stored window parts (None when it has none),
    and what the probes of `cache.elsewhere` need: the chain's extra keys, and the
    other tenants' keys the caller may be told about (empty: it may not)."""

    snapshots: SnapshotStore | None = None
    split: WindowSplit | None = None
    extra: ExtraKeys | None = None
    other_tenants: Sequence[ExtraKeys] = field(default_factory=tuple)
    # The token ids that open a reasoning block, for a model whose template strips
    # reasoning: a diverged miss where the cached child went on with them and the
    # prompt does not is `reasoning_stripped` (a yes/no about a fixed marker, compared
    # like the lengths of agreement; the child's tokens never leave).
    think: np.ndarray | None = None
    # Where images were seen, for `image_changed` (`cache.segments`); None: not kept.
    images: ImageHistory | None = None


def explain_lookup(
    pool: BlockPool,
    lower: LowerTiers,
    history: CacheHistory,
    chain: HashChain,
    parts: LookupParts | None = None,
) -> PrefixExplanation:
    """`RequestCache.restore_into`'s answer for `chain`, read-only, and the cause of its
    first recomputed token. Mirrors the restore step by step: full blocks in RAM,
    then below, a partial tail, at most `len - 1` tokens, then the cut to the last
    snapshot (recurrent models) and to the window parts found (sliding layers)."""
    parts = parts or LookupParts()
    bs = pool.block_size
    tokens = np.asarray(chain.tokens, dtype=np.int32)
    num_prompt = chain.num_tokens
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
    partial, partial_tier, tail_hash = 0, "ram", b""
    any_live = False  # a child of `key` is cached in some tier (its tokens are not kept)
    children: list[bytes] = []  # compared below, never kept or returned
    if len(rest):
        if not run:  # like restore_into: a RAM partial only right after the RAM run
            live = pool.peek_children(key)
            any_live = bool(live)
            children += live
            partial = max((common_prefix(t, rest) for t in live), default=0)
        if lower and partial == 0:
            for tier in lower.tiers:
                for meta in tier.children(key):
                    any_live = True
                    child = meta.token_ids.astype("<i4").tobytes()
                    children.append(child)
                    if parts.snapshots is not None or meta.num_tokens > bs:
                        continue  # restore_into takes no lower-tier tail for these
                    n = common_prefix(child, rest)
                    if n > partial:
                        partial, partial_tier, tail_hash = n, tier.name, meta.block_hash
    matched = num_full * bs + partial
    limit = num_prompt - 1
    kv = min(matched, limit)  # what a model without snapshots or windows restores
    cached, cut = kv, None
    if parts.snapshots is not None:
        cached = bs * parts.snapshots.peek(chain.hashes, kv // bs)
        if cached < kv:
            below = cached == bs * (kv // bs)  # every boundary the KV reaches has its state
            cut = MissCause(cached, "below_block" if below else "snapshot_missing",
                            shared_tokens=kv - cached)  # fmt: skip
    if parts.split is not None and lower and cached > k_ram * bs:
        stored = [*chain.hashes[k_ram:num_full], *([tail_hash] if tail_hash else [])]
        windowed = _window_cut(parts.split, lower, stored, k_ram, cached, bs)
        if windowed < cached:
            cached = windowed
            names = tuple(t.name for t in lower.tiers)
            cut = MissCause(cached, "evicted", None, names, shared_tokens=kv - cached)
    tiers = _by_tier(k_ram, run, partial_tier, cached, bs)
    if cut is not None:
        return PrefixExplanation(num_prompt, cached, tiers, cut)
    if matched >= limit:
        return PrefixExplanation(num_prompt, cached, tiers, None)
    names = tuple(t.name for t in lower.tiers)
    miss = _cause(history, key, rest, partial, matched, any_live, names)
    if (
        miss.reason == "diverged"
        and parts.think is not None
        and _stripped(children, rest, partial, parts.think)
    ):
        miss = MissCause(matched, "reasoning_stripped", None, names)
    if miss.reason == "new" and partial == 0 and parts.images is not None:
        k = changed_image(pool, lower, history, parts.images, chain, parts.extra, num_full)
        if k is not None:
            return PrefixExplanation(
                num_prompt, cached, tiers, MissCause(matched, "image_changed", None, names,
                                                     image_index=k)
            )  # fmt: skip
    if miss.reason in ("new", "diverged"):
        miss = _elsewhere(pool, lower, parts, tokens, miss)
    return PrefixExplanation(num_prompt, cached, tiers, miss)


def _by_tier(k_ram: int, run: list[str], partial_tier: str, cached: int, bs: int) -> dict[str, int]:
    tiers = dict.fromkeys(TIER_NAMES, 0)
    left = cached
    for tier_name in ["ram"] * k_ram + run:
        take = min(bs, left)
        tiers[tier_name] += take
        left -= take
    tiers[partial_tier] += max(0, left)
    return tiers


def _window_cut(
    split: WindowSplit, lower: LowerTiers, stored: list[bytes], base: int, n: int, bs: int
) -> int:
    """`WindowSplit.fetch_windows`' answer from the tiers' indexes: a missing window
    part of a lower-tier block ends the restore before that block; repeat, since the
    window moves."""
    present: dict[int, bool] = {}
    while True:
        lo = max(split.first_block(n, bs), base)
        hi = min(-(-n // bs), base + len(stored))
        todo = [j for j in range(lo, hi) if j not in present]
        if todo:
            keys = [split.part_key(stored[j - base]) for j in todo]
            found = [False] * len(todo)
            for tier in lower.tiers:
                for i, yes in enumerate(tier.contains(keys)):
                    found[i] = found[i] or yes
            present.update(zip(todo, found, strict=True))
        missing = next((j for j in range(lo, hi) if not present[j]), None)
        if missing is None:
            return n
        n = missing * bs


def _elsewhere(
    pool: BlockPool, lower: LowerTiers, parts: LookupParts, tokens: np.ndarray, miss: MissCause
) -> MissCause:
    """A new or diverged miss whose prefix another namespace or tenant holds says so."""
    i = miss.token_index
    changed = identity_change(lower.tiers, pool.hasher, parts.extra, tokens, i) if lower else None
    if changed is not None:
        return MissCause(i, "identity_changed", None, miss.lower_tiers, identity=changed)
    if parts.other_tenants and other_tenant_holds(
        pool, lower.tiers, tokens, i, parts.other_tenants
    ):
        return MissCause(i, "other_tenant", None, miss.lower_tiers)
    return miss


def _stripped(children: list[bytes], rest: np.ndarray, at: int, think: np.ndarray) -> bool:
    """Whether a child agreeing with `rest` up to `at` goes on there with `think`'s tokens
    (as far as the block holds them) while `rest` does not."""
    ours = rest[at : at + len(think)]
    if len(ours) and len(ours) == len(think) and np.array_equal(ours, think):
        return False
    for child in children:
        theirs = np.frombuffer(child, dtype="<i4")
        if common_prefix(child, rest) != at or len(theirs) <= at:
            continue
        k = min(len(think), len(theirs) - at)
        if np.array_equal(theirs[at : at + k], think[:k]):
            return True
    return False


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
