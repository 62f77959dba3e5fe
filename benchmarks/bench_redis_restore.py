"""Restore throughput: RedisStore.get vs plain redis-py pipelined GETs of the same bytes.

Starts its own redis-server on 127.0.0.1 (a free port, no persistence), writes
`--blocks` blocks of KV [30, 2, 3, 64, 64] float32 (about 2.9 MB each, the
shape of a 30-layer, 3-KV-head model at block size 64) through RedisStore,
then alternates the two readers over the same keys in batches of `--batch`
blocks, `--repeat` times, and prints the median throughput of each and their
ratio. The store's figure includes everything a restore does: parsing the
frame, verifying magic, namespace, shape and checksum, and building tensors.

With `--secret`, the store has a cache secret: every frame is written with a MAC and
every restore verifies it (keyed BLAKE2b over the KV and its metadata).

    .venv/bin/python benchmarks/bench_redis_restore.py [--blocks 100] [--batch 16] [--secret]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
import redis
import torch
import xxhash

from pagedkv.storage.base import BlockMeta, KVBlock
from pagedkv.storage.redis.store import RedisStore
from pagedkv.storage.secret import CacheSecret

SHAPE = (30, 2, 3, 64, 64)
NAMESPACE = "bench"


def start_server(binary: str, workdir: str) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
    args += ["no", "--dir", workdir, "--maxmemory-policy", "allkeys-lru", "--logfile", ""]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit(f"redis-server did not start on port {port}")


def make_blocks(n: int) -> list[KVBlock]:
    parent = b"\0" * 16
    blocks = []
    for i in range(n):
        tokens = np.arange(i * 64, (i + 1) * 64, dtype=np.int32)
        kv = torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))
        block_hash = xxhash.xxh3_128_digest(parent + tokens.tobytes())
        blocks.append(KVBlock(BlockMeta(block_hash, parent, tokens, NAMESPACE), kv))
        parent = block_hash
    return blocks


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    start = time.perf_counter()
    nbytes = fn()
    return time.perf_counter() - start, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="blocks per get call")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--secret", action="store_true", help="authenticate frames (MAC)")
    args = parser.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: apt-get install -y redis-server")
    workdir = tempfile.mkdtemp(prefix="pagedkv-bench-redis-")
    proc, port = start_server(binary, workdir)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        blocks = make_blocks(args.blocks)
        secret = CacheSecret(os.urandom(32)) if args.secret else None
        store = RedisStore(
            url, NAMESPACE, socket_timeout=5.0, write_queue_bytes=2 * 1024**3, secret=secret
        )
        write_s, _ = timed(lambda: (store.put(blocks), store.flush(600), 0)[2])
        written = store.stats()
        if written.blocks_written != len(blocks):
            raise SystemExit(f"only {written.blocks_written}/{len(blocks)} blocks were written")
        hashes = [b.meta.block_hash for b in blocks]
        batches = [hashes[i : i + args.batch] for i in range(0, len(hashes), args.batch)]
        plain = redis.Redis.from_url(url, socket_timeout=5.0)

        def restore_store() -> int:
            before = store.stats().bytes_read
            for batch in batches:
                got = store.get(batch)
                assert all(b is not None for b in got), "a stored block failed to restore"
            return store.stats().bytes_read - before  # value bytes, as counted below

        def restore_plain() -> int:
            total = 0
            for batch in batches:
                pipe = plain.pipeline(transaction=False)
                for h in batch:
                    pipe.get(store._key(h))
                total += sum(len(v) for v in pipe.execute())
            return total

        rates: dict[str, list[float]] = {"RedisStore.get": [], "redis-py pipelined GET": []}
        sizes: dict[str, int] = {}
        readers = [("RedisStore.get", restore_store), ("redis-py pipelined GET", restore_plain)]
        for i in range(args.repeat):
            for name, fn in readers[:: 1 if i % 2 else -1]:  # alternate who goes first
                seconds, nbytes = timed(fn)
                rates[name].append(nbytes / seconds / 1e6)
                sizes[name] = nbytes
        store.close()
        kv_mb = sizes["RedisStore.get"] / 1e6
        print(f"{'with' if args.secret else 'without'} a cache secret (MAC); "
              f"redis-server {port}: {len(blocks)} blocks x {blocks[0].num_bytes / 1e6:.2f} MB "
              f"= {kv_mb:.0f} MB KV, batch {args.batch}, median of {args.repeat}; "
              f"write {kv_mb / write_s:.0f} MB/s")  # fmt: skip
        print(f"{'reader':<26}{'MB/s':>10}{'min':>10}{'max':>10}")
        for name, values in rates.items():
            med = statistics.median(values)
            print(f"{name:<26}{med:>10.0f}{min(values):>10.0f}{max(values):>10.0f}")
        ratio = statistics.median(rates["RedisStore.get"]) / statistics.median(
            rates["redis-py pipelined GET"]
        )
        print(f"ratio RedisStore / plain GET: {ratio:.2f} (target >= 0.70)")
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
