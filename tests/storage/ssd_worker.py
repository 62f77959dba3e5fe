"""Helpers for the SSD store tests, and a script the tests run as a separate process.

`make_block(i, namespace)` is deterministic, so another process (or the test
after a restart) can rebuild the exact block it expects to read back.

Modes:
  python ssd_worker.py write DIR CAPACITY         put blocks forever; prints "ready" once
                                                  some are on disk (the test kill -9s it)
  python ssd_worker.py share DIR CAPACITY SECONDS FIRST
                                                  put blocks FIRST..FIRST+99, get blocks of
                                                  0..199 (half the other process's); every
                                                  hit must be bit-exact; prints JSON counts
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
import xxhash

from pagedkv.storage.base import BlockMeta, KVBlock
from pagedkv.storage.ssd.store import SSDStore

SHAPE = (4, 2, 2, 16, 32)  # [layers, k/v, kv_heads, tokens, head_dim]: 32 KiB in float32
NAMESPACE = "test-model"


def block_hash(i: int, namespace: str = NAMESPACE) -> bytes:
    return xxhash.xxh3_128(f"{namespace}/{i}".encode()).digest()


def make_block(
    i: int,
    namespace: str = NAMESPACE,
    shape: tuple[int, ...] = SHAPE,
    dtype: torch.dtype = torch.float32,
    parent: bytes | None = None,
) -> KVBlock:
    gen = torch.Generator().manual_seed(i)
    kv = torch.randn(shape, generator=gen).to(dtype)
    tokens = np.arange(i, i + shape[3], dtype=np.int32) % 50_000
    parent = parent if parent is not None else block_hash(i - 1, namespace)
    return KVBlock(BlockMeta(block_hash(i, namespace), parent, tokens, namespace), kv)


def same_block(a: KVBlock, b: KVBlock) -> bool:
    """Bit-exact equality of KV (compared as raw bytes) and every metadata field."""
    return (
        a.kv.dtype == b.kv.dtype
        and a.kv.shape == b.kv.shape
        and torch.equal(a.kv.contiguous().view(torch.uint8), b.kv.contiguous().view(torch.uint8))
        and np.array_equal(a.meta.token_ids, b.meta.token_ids)
        and a.meta.block_hash == b.meta.block_hash
        and a.meta.parent_key == b.meta.parent_key
        and a.meta.namespace == b.meta.namespace
    )


def _write_forever(directory: str, capacity: int) -> None:
    shape = (8, 2, 4, 64, 32)  # 512 KiB: enough bytes that a kill lands mid-write
    store = SSDStore(directory, capacity, NAMESPACE, write_buffer_bytes=16 << 20, put_wait_s=1.0)
    i = 0
    while True:
        store.put([make_block(j, shape=shape) for j in range(i, i + 8)])
        i += 8
        if i == 32:
            store.flush()
            print("ready", flush=True)


def _share(directory: str, capacity: int, seconds: float, first: int) -> int:
    store = SSDStore(directory, capacity, NAMESPACE, put_wait_s=0.5)
    rng = np.random.default_rng(first)
    deadline = time.monotonic() + seconds
    wrong = 0
    while time.monotonic() < deadline:
        store.put([make_block(int(i)) for i in rng.integers(first, first + 100, size=8)])
        store.flush()  # so that every hit below comes from disk, often the other process's
        ids = [int(i) for i in rng.integers(0, 200, size=8)]
        for i, got in zip(ids, store.get([block_hash(i) for i in ids]), strict=True):
            if got is not None and not same_block(got, make_block(i)):
                wrong += 1
    store.flush()
    stats = store.stats()
    store.close()
    summary = {"hits": stats.hits, "misses": stats.misses, "wrong": wrong}
    summary.update(written=stats.blocks_written, corrupt=stats.corrupt, errors=stats.errors)
    print(json.dumps(summary), flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    mode, directory, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "write":
        _write_forever(directory, capacity)
    else:
        sys.exit(_share(directory, capacity, float(sys.argv[4]), int(sys.argv[5])))
