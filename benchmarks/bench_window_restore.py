"""Bytes a 4K-token prefix restore reads and copies, sliding-window layers against full.

A Gemma-3-1B-shaped layout (26 KV layers, 1 KV head, head_dim 256, bfloat16;
every 6th layer global, the others sliding with a 512-token window), block
size 64, a 4,096-token cached prompt. The same prompt is restored twice into a
NaN-filled buffer: once with the sliding windows in the layout, once as if every
layer were full attention. Reported per restore: bytes copied into the buffer
(counted as the elements the restore overwrote), RAM bytes read (the RAM gather
reads exactly what it copies), SSD bytes read (the SSD tier's own counter, after
a restart with empty RAM; the sliding layers' KV is stored apart, `cache/split.py`),
and the RAM restore's time (median of 7).

    .venv/bin/python benchmarks/bench_window_restore.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedkv.cache.hashing import BlockHasher
from pagedkv.cache.pool import BlockPool
from pagedkv.cache.prefix import PrefixCache
from pagedkv.cache.ram import KVLayout, RamBlockStore
from pagedkv.cache.split import WindowSplit
from pagedkv.cache.tiers import LowerTiers
from pagedkv.storage.ssd.store import SSDStore

LAYERS, HEADS, DIM, BS, WINDOW, TOKENS = 26, 1, 256, 64, 512, 4096
WINDOWS = tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(LAYERS))
MiB = 1024**2


def make_cache(layout: KVLayout, ssd: Path) -> PrefixCache:
    hasher = BlockHasher(BS, "bench", seed=b"seed")
    pool = BlockPool(BS, 2 * TOKENS // BS, hasher=hasher)
    tier = SSDStore(ssd, 4 * 2**30, "bench")
    shape = (LAYERS, 2, HEADS, DIM)
    split = None
    if layout.windows:  # as cache/builder.py does: sliding layers stored apart
        split = WindowSplit(layout.windows, shape)
        shape = (len(split.full_rows), 2, HEADS, DIM)
    lower = LowerTiers([tier], shape)
    ram = RamBlockStore(layout, 2 * TOKENS // BS)
    return PrefixCache(pool, ram, lower, "bench", split=split)


def restore(cache: PrefixCache, prompt: list[int], kv: torch.Tensor) -> tuple[int, float, int]:
    """(tokens restored, seconds, bytes of KV copied into the buffer). Copied bytes are
    the elements that now equal the prompt's KV (a lower tier's read also zeroes the
    buffer's pages on another thread; those zeros are not KV)."""
    out = torch.full((LAYERS, 2, HEADS, len(prompt), DIM), float("nan"), dtype=torch.float32)
    handle = cache.begin(prompt)
    t = time.perf_counter()
    n = handle.restore_into(out, len(prompt) - 1)
    took = time.perf_counter() - t
    handle.release()
    copied = int((out == kv).sum()) * out.element_size()
    return n, took, copied


def run(windows: tuple[int | None, ...], label: str) -> None:
    layout = KVLayout(LAYERS, HEADS, DIM, BS, torch.float32, windows=windows)
    prompt = [(7 * i + 3) % 30000 for i in range(TOKENS + 1)]
    kv = torch.randn(LAYERS, 2, HEADS, len(prompt), DIM).to(torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        cache = make_cache(layout, Path(tmp))
        handle = cache.begin(prompt)
        handle.restore_into(torch.zeros_like(kv), len(prompt) - 1)
        handle.cache_prompt(lambda a, b: kv[:, :, :, a:b])
        handle.release()
        times = [restore(cache, prompt, kv) for _ in range(7)]  # from RAM
        n, _, ram_bytes = times[0]
        ram_ms = statistics.median(t for _, t, _ in times) * 1e3
        cache.close(30.0)
        fresh = make_cache(layout, Path(tmp))  # a restart: RAM empty, SSD full
        before = fresh.lower.tiers[0].stats().bytes_read
        n_ssd, _, ssd_copied = restore(fresh, prompt, kv)
        ssd_read = fresh.lower.tiers[0].stats().bytes_read - before
        fresh.close(30.0)
    assert n == n_ssd == TOKENS
    print(
        f"{label:<34} {n:>6} {ram_bytes / MiB:>10.1f} {ram_ms:>9.1f} "
        f"{ssd_read / MiB:>12.1f} {ssd_copied / MiB:>12.1f}"
    )


def main() -> None:
    print(
        f"{'layout':<34} {'tokens':>6} {'RAM MiB':>10} {'RAM ms':>9} "
        f"{'SSD read MiB':>12} {'SSD copy MiB':>12}"
    )
    run(WINDOWS, f"22 sliding ({WINDOW}) + 4 global")
    run((), "26 full attention (same data)")


if __name__ == "__main__":
    main()
