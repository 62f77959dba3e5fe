"""A request's restore (`RequestCache.restore_into`), step by step: find, trim, write.

1. `find_lower`: after the RAM match, the lower tiers' full blocks, then a partial
   tail block; while a tier reads, other threads fault the target's pages in, and
   where every layer keeps the whole prefix in one entry a block goes into the
   target as soon as its read completes (`RestorePlan.placed`).
2. `trim_to_snapshot`: a model with recurrent layers restores only up to the last
   block with a snapshot of its state. `trim_to_windows`: a split store's sliding
   layers keep their windows apart; the prefix ends where those are found.
3. `write`: the RAM blocks, the lower tiers' blocks and the tail into the target.
The caller (`RequestCache`) then counts the hits by tier; on any error it releases
what the plan holds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedkv.cache.block import Block
from pagedkv.cache.hashing import HashChain
from pagedkv.cache.prefault import prefault as start_prefault
from pagedkv.cache.tiers import Found
from pagedkv.cache.window import copy_prefix

if TYPE_CHECKING:
    from pagedkv.cache.prefix import PrefixCache


@dataclass(slots=True)
class RestorePlan:
    """What a restore found: `full` RAM blocks (the handle's table) and a `partial`
    one (acquired until written), `found` below RAM after them, a `tail`; `n` tokens
    to restore, of which `ram_tokens` from RAM."""

    full: list[Block]
    partial: Block | None
    ram_tokens: int
    found: list[Found] = field(default_factory=list)
    placed: set[int] = field(default_factory=set)  # `found` already in the target
    tail: Found | None = None
    tail_tokens: int = 0
    parts: list[torch.Tensor | None] | None = None  # the found blocks' windows (split)
    state: torch.Tensor | None = None  # the recurrent state after `n` (snapshots)
    reached: int = 0  # full blocks found in any tier, before the trims
    n: int = 0

    @property
    def num_full(self) -> int:
        """Full blocks found in any tier."""
        return len(self.full) + len(self.found)


def find_lower(cache: PrefixCache, chain: HashChain, plan: RestorePlan, out: torch.Tensor) -> None:
    """The lower tiers' blocks after the RAM match, then a partial tail block (only
    where no state snapshots bound the prefix). Joins every prefault thread it
    started before it returns or raises: none is left writing into `out`."""
    bs, lower = cache.block_size, cache.lower
    early = cache.split is None and cache.snapshots is None and not cache.ram.layout.windows
    first = len(plan.full) * bs
    prefault: list[threading.Thread] = []

    def place(i: int, f: Found) -> None:
        lo = first + i * bs
        if lo + bs <= out.shape[3] and f.block.kv.dtype == out.dtype:
            out[:, :, :, lo : lo + bs].copy_(f.block.kv)
            plan.placed.add(i)

    def before_read(run: int) -> None:
        skip = (first, first + run * bs) if early else (0, 0)
        prefault.append(start_prefault(out, skip))

    try:
        if lower and len(plan.full) < len(chain.hashes):
            plan.found = lower.fetch_full(
                chain.hashes,
                chain.parent_keys,
                chain.tokens,
                len(plan.full),
                bs,
                before_read,
                place if early else None,
            )
        if plan.found and plan.partial is not None:  # whole blocks beat a partial match
            cache.pool.free([plan.partial])
            plan.partial, plan.ram_tokens = None, len(plan.full) * bs
        num_full = plan.reached = plan.num_full
        if (
            lower
            and cache.snapshots is None
            and plan.partial is None
            and num_full * bs < chain.num_tokens
        ):
            hit = lower.fetch_partial(chain.parent_keys[num_full], chain.tokens[num_full * bs :])
            if hit is not None:
                plan.tail, plan.tail_tokens = hit
    finally:
        for thread in prefault:
            thread.join()


def trim_to_snapshot(cache: PrefixCache, chain: HashChain, plan: RestorePlan) -> None:
    """End the prefix at the last block with a snapshot of the recurrent state."""
    bs, snapshots = cache.block_size, cache.snapshots
    assert snapshots is not None
    blocks, plan.state = snapshots.find(chain.hashes, chain.tokens, bs, plan.n // bs)
    plan.n = blocks * bs
    plan.found = plan.found[: max(0, blocks - len(plan.full))]


def trim_to_windows(cache: PrefixCache, plan: RestorePlan) -> None:
    """End the prefix where the sliding layers' windows, stored apart, are found."""
    bs, split, lower = cache.block_size, cache.split, cache.lower
    assert split is not None and lower is not None
    stored = [f.block for f in plan.found] + ([plan.tail.block] if plan.tail else [])
    plan.n, parts = split.fetch_windows(lower.tiers, stored, len(plan.full), plan.n, bs)
    plan.found = plan.found[: max(0, min(len(plan.found), -(-plan.n // bs) - len(plan.full)))]
    if plan.tail is not None and plan.n <= plan.reached * bs:
        plan.tail = None
    plan.parts = parts


def write(cache: PrefixCache, plan: RestorePlan, out: torch.Tensor) -> None:
    """Copy the plan's `n` tokens into `out` (what `find_lower` placed is skipped)."""
    ids = [b.block_id for b in plan.full] + ([plan.partial.block_id] if plan.partial else [])
    found = plan.found
    pieces = [f.block.kv for f in found] + ([plan.tail.block.kv] if plan.tail else [])
    done = next((i for i in range(len(found)) if i not in plan.placed), len(found))
    copy_prefix(
        cache.ram, ids, plan.ram_tokens, pieces, plan.parts, len(plan.full), out, plan.n, done
    )
