"""CPU cost of verifying one SSD block file: `decode_file` with and without a cache secret.

The file is built in memory (no disk), so this is parse + checksum (+ MAC) only:
what the read threads spend per block on top of the I/O. The block is 768 KiB
of bfloat16 KV, a 64-token block of a 6-attention-layer model (4 KV heads,
head_dim 128). Also prints the raw rates of the hashes the MAC can build on.

    .venv/bin/python benchmarks/bench_ssd_decode.py [--reps 300]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import numpy as np
import torch
import xxhash

from pagedkv.storage.base import BlockMeta, KVBlock, block_checksum
from pagedkv.storage.secret import CacheSecret
from pagedkv.storage.ssd.format import decode_file, encode_file

SHAPE = (6, 2, 4, 64, 128)


def _block() -> KVBlock:
    kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    h = xxhash.xxh3_128(b"bench").digest()
    meta = BlockMeta(h, bytes(16), np.arange(SHAPE[3], dtype=np.int32), "bench-model")
    return KVBlock(meta, kv)


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    block = _block()
    secret = CacheSecret(b"k" * 32)
    print(f"block: KV {list(SHAPE)} bfloat16, {block.kv.numel() * 2 / 1024:.0f} KiB")
    for label, key in (("no secret", None), ("secret", secret)):
        prefix, buffers = encode_file(block, block_checksum(block), key)
        raw = bytearray(prefix + b"".join(bytes(b) for b in buffers))
        data = torch.frombuffer(raw, dtype=torch.uint8)
        h = block.meta.block_hash
        decode_file(data, h, secret=key)  # warm up; and it must verify
        us = _median_us(lambda d=data, h=h, k=key: decode_file(d, h, secret=k), args.reps)
        print(f"decode_file, {label:9s}: {us:7.0f} us per block (median of {args.reps})")
    payload = block.kv.view(torch.uint8).reshape(-1).numpy().data
    for name, make in (
        ("sha256", hashlib.sha256),
        ("blake2b", lambda d: hashlib.blake2b(d, digest_size=16)),
        ("xxh3_128", xxhash.xxh3_128),
    ):
        us = _median_us(lambda m=make: m(payload).digest(), args.reps)
        print(f"{name:9s}: {us:7.0f} us per block, {payload.nbytes / us:6.0f} MB/s")


if __name__ == "__main__":
    main()
