"""Sliding-window layers restore their window only; snapshots restore at boundaries."""

from __future__ import annotations

import torch
from memory_tier import MemoryTier, fake_kv

from pagedkv.cache.hashing import BlockHasher
from pagedkv.cache.pool import BlockPool
from pagedkv.cache.prefix import PrefixCache
from pagedkv.cache.ram import KVLayout, RamBlockStore
from pagedkv.cache.snapshots import SnapshotStore
from pagedkv.cache.split import WindowSplit
from pagedkv.cache.tiers import LowerTiers
from pagedkv.cache.window import LayerRun, restored_bytes, window_runs

BS = 4
# Gemma-style: two sliding layers (window 8), one global, one sliding.
LAYOUT = KVLayout(4, 2, 3, BS, torch.float32, windows=(8, 8, None, 8))
KV_SHAPE = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def make_cache(*tiers: MemoryTier, layout: KVLayout = LAYOUT, state: int = 0) -> PrefixCache:
    hasher = BlockHasher(BS, "ns", seed=b"seed")
    pool = BlockPool(BS, 64, hasher=hasher)
    snapshots = SnapshotStore(state, 2**20, list(tiers), "ns", BS) if state else None
    shape = (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
    split = None
    if layout.windows:  # as cache/builder.py does it
        split = WindowSplit(layout.windows, shape)
        shape = (len(split.full_rows), *shape[1:])
    lower = LowerTiers(list(tiers), shape)
    return PrefixCache(pool, RamBlockStore(layout, 64), lower, "ns", snapshots, split)


def test_runs_group_layers_by_the_first_block_they_need() -> None:
    # restore point 30: a window of 8 needs keys [23, 30), from block 5 (token 20) on
    runs = window_runs(LAYOUT.windows, 4, 30, BS)
    # (rows in the stored parts: sliding layers 0, 1, 3 are rows 0, 1, 2 of theirs)
    assert runs == [LayerRun(0, 2, 5, True, 0), LayerRun(2, 3, 0), LayerRun(3, 4, 5, True, 2)]
    assert window_runs((), 4, 30, BS) == [LayerRun(0, 4, 0)]
    # shorter than a window: a sliding layer needs all of it, still a run of its own
    assert window_runs((8, None), 2, 5, BS) == [LayerRun(0, 1, 0, True), LayerRun(1, 2, 0)]
    # 4K tokens, window 128, block 64: a sliding layer copies 128 + 63 tokens at most
    per_layer = restored_bytes((128,), 4096, 64, 1)
    assert 127 <= per_layer <= 128 + 64 and restored_bytes((None,), 4096, 64, 1) == 4096


def _serve(cache: PrefixCache, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """Restore into a NaN-filled buffer (to see what was written), then "compute" the
    rest and cache it all; returns (tokens restored, the buffer after the restore)."""
    handle = cache.begin(prompt)
    try:
        out = torch.full((*KV_SHAPE[:3], len(prompt), KV_SHAPE[3]), float("nan"))
        n = handle.restore_into(out, len(prompt) - 1)
        seen = out.clone()
        kv = fake_kv(LAYOUT, prompt)
        out[:, :, :, n:] = kv[:, :, :, n:]  # the forward computes what was not restored
        handle.cache_prompt(lambda a, b: out[:, :, :, a:b])
        handle.cache_finished(prompt, lambda a, b: out[:, :, :, a:b])
        return n, seen
    finally:
        handle.release()


def _check_window(seen: torch.Tensor, prompt: list[int], n: int) -> None:
    want = fake_kv(LAYOUT, prompt)
    for run in window_runs(LAYOUT.windows, 4, n, BS):
        start = run.first_block * BS
        rows = seen[run.layers]
        assert torch.equal(rows[:, :, :, start:n], want[run.layers, :, :, start:n])
        # untouched: NaN, or zero where a lower tier's read prefaulted the pages
        before = rows[:, :, :, :start]
        assert (before.isnan() | (before == 0)).all(), "a sliding layer got more than its window"


def test_a_sliding_layer_gets_its_window_from_ram_and_from_a_lower_tier() -> None:
    tier = MemoryTier("ssd")
    prompt = list(range(10, 41))  # 31 tokens: 7 full blocks and 3 tokens
    first = make_cache(tier)
    assert _serve(first, prompt)[0] == 0
    n, seen = _serve(first, prompt)  # from RAM
    assert n == len(prompt) - 1
    _check_window(seen, prompt, n)
    # A restart: RAM is empty, the tier has every block. The restore reads the window
    # parts of the blocks in the window only: blocks 5 and 6 and the 3-token tail.
    parts = {WindowSplit.part_key(h) for h in first.begin(prompt).chain.hashes}
    tier.gets.clear()
    probe = make_cache(tier)
    handle = probe.begin(prompt)
    out = torch.full((*KV_SHAPE[:3], len(prompt), KV_SHAPE[3]), float("nan"))
    assert handle.restore_into(out, len(prompt) - 1) == len(prompt) - 1
    handle.release()
    read_parts = [h for h in tier.gets if h not in tier.blocks or h not in parts]
    assert len(tier.gets) - len(read_parts) == 2 and len(read_parts) == 7 + 1 + 1
    _check_window(out, prompt, len(prompt) - 1)
    fresh = make_cache(tier)
    n, seen = _serve(fresh, prompt)
    assert n == len(prompt) - 1
    _check_window(seen, prompt, n)
    # What the restart cached in RAM is the tier's whole blocks, not the NaN-holed
    # buffer: a shorter prompt, whose window starts earlier, still restores exactly.
    short = prompt[:15]
    n, seen = _serve(fresh, short)
    assert n == len(short) - 1
    _check_window(seen, short, n)


def test_state_models_restore_only_at_a_snapshot_with_its_state() -> None:
    layout = KVLayout(1, 2, 3, BS, torch.float32)
    tier = MemoryTier("redis")
    cache = make_cache(tier, layout=layout, state=5)
    prompt = list(range(20, 43))  # 23 tokens
    handle = cache.begin(prompt)
    out = torch.zeros(1, 2, 2, len(prompt), 3)
    assert handle.restore_into(out, len(prompt) - 1) == 0
    kv = fake_kv(layout, prompt)
    states = {p: torch.full((5,), float(p)) for p in (8, 12)}  # taken at 8 and 12 only
    handle.cache_prompt(lambda a, b: kv[:, :, :, a:b], states)
    handle.release()
    again = cache.begin([*prompt, 1])
    n = again.restore_into(torch.zeros(1, 2, 2, 24, 3), 23)
    assert n == 12 and again.restored_state is not None
    assert torch.equal(again.restored_state, torch.full((5,), 12.0))
    again.release()
    # A restart: the KV blocks and the snapshots come back from the lower tier.
    fresh = make_cache(tier, layout=layout, state=5)
    third = fresh.begin([*prompt[:11], 7, 7])
    assert third.restore_into(torch.zeros(1, 2, 2, 13, 3), 12) == 8
    assert third.restored_state is not None and float(third.restored_state[0]) == 8.0
    assert third.tier_hits == {"redis": 8}
    third.release()
