"""SSD restore throughput against the disk's sequential read bandwidth, same run.

Fills an SSD store with realistic blocks (SmolLM2-135M, float32, block size 64:
KV [30, 2, 3, 64, 64] = 2.9 MiB per block), then alternates cold reads:

- sequential: one plain file of the same total size, read once buffered and
  once with O_DIRECT, 8 MiB at a time (`disk_reads.py`);
- restore: `SSDStore.get` of every block, 64 blocks (a 4K-token prefix) per call,
  which parses, verifies the checksum and returns tensors.

Before each read the page cache is dropped for every file involved (a sync,
then `POSIX_FADV_DONTNEED`) and checked empty with `mincore`, so all of them
come from the disk. The store picks its read path (O_DIRECT or buffered) by
measuring its own cold restores (`storage/ssd/reader.py`); `--learn` cold
restores run first (more while either path lacks the samples the choice
needs), as a store that has served a while has done, and the bench prints what
it measured, the path each timed restore took and the one it chose. The target
is restore >= 80% of the faster sequential read of the same run.

The last line, `SUMMARY ...`, holds the run's figures as `key=value` pairs.

    .venv/bin/python benchmarks/bench_ssd_restore.py [--dir DIR] [--total-mib 384]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pagedkv.storage.base import BlockMeta, KVBlock
from pagedkv.storage.ssd.reader import MIN_SAMPLES, ReadBatch
from pagedkv.storage.ssd.store import SSDStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_reads import drop_cache, sequential_reads

SHAPE = (30, 2, 3, 64, 64)  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; 64 tokens
MiB = 1024**2


def restore(store: SSDStore, hashes: list[bytes], per_get: int) -> tuple[int, float]:
    total = 0
    start = time.perf_counter()
    for i in range(0, len(hashes), per_get):
        for block in store.get(hashes[i : i + per_get]):
            assert block is not None, "a stored block was not restored"
            total += block.num_bytes
    return total, time.perf_counter() - start


def make_blocks(count: int) -> list[KVBlock]:
    gen = torch.Generator().manual_seed(0)
    parent = b"\0" * 16
    blocks = []
    for i in range(count):
        block_hash = i.to_bytes(4, "big") + os.urandom(12)
        tokens = np.arange(i * SHAPE[3], (i + 1) * SHAPE[3], dtype=np.int32)
        kv = torch.randn(SHAPE, generator=gen)
        blocks.append(KVBlock(BlockMeta(block_hash, parent, tokens, "bench"), kv))
        parent = block_hash
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="directory on the disk to measure (default: system temp)")
    parser.add_argument("--total-mib", type=int, default=384, help="bytes of KV to restore")
    parser.add_argument("--per-get", type=int, default=64, help="blocks per get call")
    parser.add_argument("--read-threads", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--learn", type=int, default=4, help="cold restores before timing")
    parser.add_argument(
        "--read-path", choices=["auto", "direct", "buffered"], default="auto",
        help="auto: the store measures and chooses",
    )  # fmt: skip
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="pagedkv-bench-ssd-", dir=args.dir))
    try:
        block_bytes = int(np.prod(SHAPE)) * 4
        count = max(1, args.total_mib * MiB // block_bytes)
        blocks = make_blocks(count)
        store = SSDStore(
            root / "kv",
            4 * count * block_bytes,
            "bench",
            read_threads=args.read_threads,
            read_path=None if args.read_path == "auto" else args.read_path,
        )
        start = time.perf_counter()
        for i in range(0, count, 32):  # within the write budget: nothing may be dropped
            store.put(blocks[i : i + 32])
            assert store.flush(300)
        write_s = time.perf_counter() - start
        assert store.stats().blocks_written == count
        hashes = [b.meta.block_hash for b in blocks]
        plain = root / "sequential.bin"
        with open(plain, "wb") as f:
            for block in blocks:
                f.write(block.kv.numpy().tobytes())
        del blocks
        files = [p for p in (root / "kv" / "blocks").rglob("*") if p.is_file()]
        print(
            f"{count} blocks of {block_bytes / MiB:.2f} MiB ({count * block_bytes / MiB:.0f} MiB) "
            f"in {root}, {args.read_threads} read threads, {args.per_get} blocks per get"
        )
        os.sync()  # no writeback competing with the reads below
        restore(store, hashes, args.per_get)  # warm up code paths, then measure warm once
        warm_bytes, warm_s = restore(store, hashes, args.per_get)
        chooser = store.reader.chooser
        learn = 0
        while learn < args.learn or (
            chooser.fixed is None
            and learn < 4 * max(args.learn, MIN_SAMPLES)
            and min(len(v) for v in chooser.samples().values()) < MIN_SAMPLES
        ):
            drop_cache(files)
            restore(store, hashes, args.per_get)
            learn += 1
        learned = chooser.samples()
        paths: list[str] = []
        begin = store.reader.begin

        def tracked() -> ReadBatch:  # the path each get of a timed restore takes
            batch = begin()
            paths.append(batch.path)
            return batch

        store.reader.begin = tracked  # type: ignore[method-assign]
        rows = []
        took = []
        for _ in range(args.repeat):
            rates = sequential_reads(plain)
            drop_cache(files)
            paths.clear()
            got_bytes, got_s = restore(store, hashes, args.per_get)
            rows.append((rates["buffered"], rates["O_DIRECT"], got_bytes / got_s))
            took.append("+".join(sorted(set(paths))))
        chosen = store.reader.path
        store.close()
        print(f"\n{'run':>4} {'buffered MiB/s':>15} {'O_DIRECT MiB/s':>15}", end="")
        print(f" {'restore MiB/s':>14} {'ratio':>6}  path")
        ratios = [got / max(seq, direct) for seq, direct, got in rows]
        for run, ((seq, direct, got), ratio) in enumerate(zip(rows, ratios, strict=True)):
            print(f"{run:>4} {seq / MiB:>15.0f} {direct / MiB:>15.0f}", end="")
            print(f" {got / MiB:>14.0f} {ratio:>6.2f}  {took[run]}")
        med = [statistics.median(r[k] for r in rows) / MiB for k in range(3)]
        ratio = statistics.median(ratios)
        print(f"{'med':>4} {med[0]:>15.0f} {med[1]:>15.0f} {med[2]:>14.0f} {ratio:>6.2f}")
        print("\nratio = restore / the faster sequential read of the same run")
        for path, mib_s in learned.items():
            figures = " ".join(f"{x:.0f}" for x in mib_s) or "-"
            print(f"learned {path:>8} MiB/s: {figures}")
        print(f"read path chosen: {chosen} (after {learn} cold restores)")
        print(f"warm page cache restore (CPU-bound ceiling): {warm_bytes / warm_s / MiB:.0f} MiB/s")
        write_rate = count * block_bytes / write_s / MiB
        print(f"write (put + flush, into the page cache): {write_rate:.0f} MiB/s")
        verdict = "meets" if ratio >= 0.80 else "MISSES"
        print(
            f"restore / sequential: median {ratio:.2f} ({verdict} the >= 0.80 target), "
            f"lowest of {len(ratios)} {min(ratios):.2f}"
        )
        print(
            f"SUMMARY ratio={ratio:.3f} lowest={min(ratios):.3f} path={chosen} "
            f"buffered_mib_s={med[0]:.0f} direct_mib_s={med[1]:.0f} restore_mib_s={med[2]:.0f} "
            f"warm_mib_s={warm_bytes / warm_s / MiB:.0f} write_mib_s={write_rate:.0f}"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
