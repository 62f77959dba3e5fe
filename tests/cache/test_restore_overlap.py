"""A restore copies each lower-tier block into the request's buffer as its read
completes, while another thread faults the buffer in without disturbing it."""

from __future__ import annotations

import mmap

import pytest
import torch
from memory_tier import MemoryTier, fake_kv

from pagedkv.cache import prefault as prefault_mod
from pagedkv.cache import restore as restore_mod
from pagedkv.cache.hashing import BlockHasher
from pagedkv.cache.pool import BlockPool
from pagedkv.cache.prefix import PrefixCache
from pagedkv.cache.ram import KVLayout, RamBlockStore
from pagedkv.cache.tiers import LowerTiers

BS = 4
LAYOUT = KVLayout(3, 2, 3, BS, torch.float32)  # every layer full: blocks go in early
SHAPE = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)


def make_cache(tier: MemoryTier) -> PrefixCache:
    hasher = BlockHasher(BS, "ns", seed=b"seed")
    pool = BlockPool(BS, 64, hasher=hasher)
    return PrefixCache(pool, RamBlockStore(LAYOUT, 64), LowerTiers([tier], SHAPE), "ns")


def mapped(shape: tuple[int, ...]) -> torch.Tensor:
    """A fresh anonymous map, as the engine's KV buffers are."""
    count = 1
    for d in shape:
        count *= d
    m = mmap.mmap(-1, count * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.float32).view(shape)


def _serve(cache: PrefixCache, prompt: list[int]) -> tuple[int, torch.Tensor]:
    handle = cache.begin(prompt)
    try:
        out = mapped((*SHAPE[:3], len(prompt) + 8, SHAPE[3]))
        n = handle.restore_into(out, len(prompt) - 1)
        seen = out.clone()
        out[:, :, :, n : len(prompt)] = fake_kv(LAYOUT, prompt)[:, :, :, n:]
        handle.cache_prompt(lambda a, b: out[:, :, :, a:b])
        handle.cache_finished(prompt, lambda a, b: out[:, :, :, a:b])
        return n, seen
    finally:
        handle.release()


def test_lower_tier_blocks_are_placed_as_they_arrive_and_not_copied_again(monkeypatch) -> None:
    tier = MemoryTier("ssd")
    prompt = list(range(100, 127))  # 6 full blocks and 3 tokens
    _serve(make_cache(tier), prompt)  # fills the tier
    placed_args: list[int] = []
    real = restore_mod.copy_prefix

    def spy(*args: object) -> None:
        placed_args.append(args[8] if len(args) > 8 else 0)  # type: ignore[arg-type]
        real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(restore_mod, "copy_prefix", spy)
    n, seen = _serve(make_cache(tier), prompt)  # a restart: RAM empty, the tier has it
    assert n == len(prompt) - 1
    assert placed_args == [6], "the tier's blocks were not copied in as they arrived"
    want = fake_kv(LAYOUT, prompt)
    assert torch.equal(seen[:, :, :, :n], want[:, :, :, :n])
    assert (seen[:, :, :, len(prompt) :] == 0).all()


def test_a_block_failing_its_check_is_not_placed(monkeypatch) -> None:
    tier = MemoryTier("ssd")
    prompt = list(range(200, 221))  # 5 full blocks and 1 token
    _serve(make_cache(tier), prompt)
    cache = make_cache(tier)
    third = cache.begin(prompt).chain.hashes[2]
    bad = tier.blocks[third]
    tier.blocks[third] = type(bad)(bad.meta, torch.full_like(bad.kv, 7.0)[:, :, :, :2])
    n, seen = _serve(cache, prompt)
    assert n == 2 * BS, "the restore stops before the block with the wrong shape"
    assert torch.equal(seen[:, :, :, :n], fake_kv(LAYOUT, prompt)[:, :, :, :n])
    assert not (seen == 7.0).any()


@pytest.mark.parametrize("populate", [True, False], ids=["populate", "zero-fallback"])
def test_prefault_never_disturbs_what_the_restore_writes(monkeypatch, populate: bool) -> None:
    if not populate:
        monkeypatch.setattr(prefault_mod, "_populate", lambda ptr, nbytes: False)
    out = mapped((2, 2, 3, 40, 8))
    out[:, :, :, 8:24] = 5.0  # the block range a restore is writing meanwhile
    prefault_mod.prefault(out, (8, 24)).join(10)
    assert (out[:, :, :, 8:24] == 5.0).all()
    assert (out[:, :, :, :8] == 0).all() and (out[:, :, :, 24:] == 0).all()
