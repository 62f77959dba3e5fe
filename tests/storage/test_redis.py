"""RedisStore against a real redis-server: verification, sharing, faults, eviction."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from fixtures_redis import make_block, make_chain

import pagedkv
from pagedkv.storage.base import KVBlock
from pagedkv.storage.redis.format import decode_frame, encode_frame
from pagedkv.storage.redis.store import MAX_CHILDREN, SEED_KEY, RedisStore

pytestmark = pytest.mark.redis

NS = "0123abcd"


@pytest.fixture
def open_store() -> Iterator[Callable[..., RedisStore]]:
    stores: list[RedisStore] = []

    def factory(url: str, namespace: str = NS, **kwargs: float | int) -> RedisStore:
        stores.append(RedisStore(url, namespace, **kwargs))  # type: ignore[arg-type]
        return stores[-1]

    yield factory
    for store in stores:
        store.close()


def assert_same_block(got: KVBlock | None, want: KVBlock) -> None:
    assert got is not None
    assert got.meta.block_hash == want.meta.block_hash
    assert got.meta.parent_key == want.meta.parent_key
    assert got.meta.namespace == want.meta.namespace
    assert np.array_equal(got.meta.token_ids, want.meta.token_ids)
    assert got.kv.dtype == want.kv.dtype and got.kv.shape == want.kv.shape
    assert torch.equal(got.kv.view(torch.uint8), want.kv.contiguous().view(torch.uint8))


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(redis_url: str, open_store, dtype: torch.dtype) -> None:
    store = open_store(redis_url)
    blocks = make_chain(NS, num_blocks=4, dtype=dtype)
    blocks[1].kv[0, 0, 0, 0, 0] = float("nan")  # NaN payloads survive bit for bit
    store.put(blocks)
    assert store.flush(5)
    missing = b"\x00" * 16
    assert store.contains([b.meta.block_hash for b in blocks] + [missing]) == [True] * 4 + [False]
    got = store.get([b.meta.block_hash for b in blocks] + [missing])
    for g, want in zip(got, blocks, strict=False):
        assert_same_block(g, want)
    assert got[-1] is None
    got[0].kv.add_(1)  # the returned tensor owns writable memory
    s = store.stats()
    assert (s.hits, s.misses, s.blocks_written, s.corrupt, s.errors) == (4, 1, 4, 0, 0)
    assert s.bytes_written >= sum(b.num_bytes for b in blocks)
    assert s.bytes_read == s.bytes_written
    assert s.extra["available"] is True


def test_frame_codec_rejects_any_mismatch() -> None:
    block = make_block(NS, b"p" * 16, np.arange(8), seed=1)
    frame = encode_frame(block)
    assert_same_block(decode_frame(frame, block.meta.block_hash, NS), block)
    assert_same_block(decode_frame(bytearray(frame), block.meta.block_hash, NS), block)
    assert decode_frame(frame, b"x" * 16, NS) is None  # stored under another hash
    assert decode_frame(frame, block.meta.block_hash, "other") is None


def test_unsupported_dtype_is_dropped_not_stored(redis_url: str, open_store) -> None:
    store = open_store(redis_url)
    good = make_chain(NS, num_blocks=1)[0]
    bad = make_block(NS, b"p" * 16, np.arange(4), seed=1, dtype=torch.int8)
    store.put([bad, good])
    assert store.flush(5)
    s = store.stats()
    assert (s.blocks_written, s.writes_dropped) == (1, 1)
    assert store.contains([bad.meta.block_hash, good.meta.block_hash]) == [False, True]


def test_concurrent_readers_and_writers_see_only_verified_blocks(
    redis_url: str, open_store
) -> None:
    store = open_store(redis_url)
    chains = [make_chain(NS, num_blocks=8, seed=s) for s in range(4)]
    errors: list[BaseException] = []

    def worker(chain: list[KVBlock]) -> None:
        try:
            for i in range(len(chain)):
                store.put(chain[i : i + 1])
                for got, want in zip(
                    store.get([b.meta.block_hash for b in chain]), chain, strict=True
                ):
                    if got is not None:
                        assert_same_block(got, want)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(c,)) for c in chains]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert store.flush(5)
    s = store.stats()
    assert s.blocks_written == 32 and s.corrupt == 0 and s.errors == 0
    assert s.hits + s.misses == 4 * 8 * 8


def test_store_in_another_process_shares_blocks(redis_url: str, open_store) -> None:
    script = textwrap.dedent(
        f"""
        from pagedkv.storage.redis.store import RedisStore
        from fixtures_redis import make_chain
        store = RedisStore({redis_url!r}, {NS!r})
        store.put(make_chain({NS!r}, num_blocks=3, dtype=__import__("torch").float32))
        assert store.flush(10)
        assert store.seed(b"child-seed") == b"child-seed"
        store.close()
        """
    )
    # The child imports the same pagedkv and test helpers as this process.
    paths = [Path(__file__).parents[1], Path(pagedkv.__file__).parents[1]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=60)
    store = open_store(redis_url)
    want = make_chain(NS, num_blocks=3, dtype=torch.float32)
    for got, block in zip(store.get([b.meta.block_hash for b in want]), want, strict=True):
        assert_same_block(got, block)
    assert store.seed(b"parent-seed") == b"child-seed"


def test_namespaces_are_isolated(redis_url: str, open_store) -> None:
    a, b = open_store(redis_url, "aaaa"), open_store(redis_url, "bbbb")
    blocks = make_chain("aaaa", num_blocks=2)
    a.put(blocks)
    assert a.flush(5)
    hashes = [blk.meta.block_hash for blk in blocks]
    assert b.contains(hashes) == [False, False]
    assert b.get(hashes) == [None, None]
    assert b.children(blocks[0].meta.parent_key) == []
    # A value copied under the other namespace's key is foreign: a miss, deleted.
    raw = redis.Redis.from_url(redis_url)
    raw.set(b._key(hashes[0]), raw.get(a._key(hashes[0])))
    assert b.get(hashes[:1]) == [None]
    assert b.stats().corrupt == 1
    assert not raw.exists(b._key(hashes[0]))
    assert a.get(hashes[:1])[0] is not None
    with pytest.raises(ValueError, match="namespace"):
        RedisStore(redis_url, "a:children")


def flip(value: bytes, at: int) -> bytes:
    return value[:at] + bytes([value[at] ^ 0x01]) + value[at + 1 :]


def tokens_offset(value: bytes) -> int:
    return 12 + int.from_bytes(value[8:12], "little")


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "kv byte flipped": lambda v: flip(v, len(v) - 5),
    "token byte flipped": lambda v: flip(v, tokens_offset(v) + 2),
    "header byte flipped": lambda v: flip(v, 20),
    "truncated": lambda v: v[: len(v) // 2],
    "garbage": lambda v: os.urandom(len(v)),
    "bad magic": lambda v: b"XKVR" + v[4:],
    "future version": lambda v: v[:4] + b"\x09" + v[5:],
    "empty": lambda v: b"",
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupted_value_is_a_miss_and_is_deleted(redis_url: str, open_store, kind: str) -> None:
    store = open_store(redis_url)
    good, victim = make_chain(NS, num_blocks=2)
    store.put([good, victim])
    assert store.flush(5)
    raw = redis.Redis.from_url(redis_url)
    key = store._key(victim.meta.block_hash)
    raw.set(key, CORRUPTIONS[kind](raw.get(key)))
    got = store.get([good.meta.block_hash, victim.meta.block_hash])
    assert_same_block(got[0], good)
    assert got[1] is None
    assert store.stats().corrupt == 1
    assert not raw.exists(key)
    assert store.stats().extra["available"] is True


def test_dead_redis_costs_only_misses_and_each_call_returns_fast(
    redis_server_factory, open_store
) -> None:
    server = redis_server_factory()
    store = open_store(server.url, backoff_initial_s=0.2, backoff_max_s=0.4)
    blocks = make_chain(NS, num_blocks=3)
    store.put(blocks)
    assert store.flush(5)
    hashes = [b.meta.block_hash for b in blocks]
    server.stop()
    calls: list[tuple[str, Callable[[], object], object]] = [
        ("get", lambda: store.get(hashes), [None] * 3),
        ("contains", lambda: store.contains(hashes), [False] * 3),
        ("children", lambda: store.children(blocks[0].meta.parent_key), []),
        ("seed", lambda: store.seed(b"s"), None),
        ("put", lambda: store.put(make_chain(NS, num_blocks=2, seed=9)), None),
    ]
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:  # spans several backoff periods and probes
        for name, call, want in calls:
            result, elapsed = timed(call)
            assert result == want, name
            assert elapsed < 1.0, f"{name} waited {elapsed:.2f} s on a dead Redis"
    assert store.flush(2)
    s = store.stats()
    assert s.errors >= 2 and s.extra["skipped"] > s.errors  # most calls never touched the network
    assert s.misses > 0 and s.writes_dropped > 0 and s.hits == 0
    assert s.extra["available"] is False or s.extra["consecutive_failures"] > 0


def test_black_holed_redis_times_out_within_a_second(redis_server_factory, open_store) -> None:
    server = redis_server_factory()
    store = open_store(server.url)
    blocks = make_chain(NS, num_blocks=2)
    store.put(blocks)
    assert store.flush(5)
    server.pause()  # accepts TCP connections, never answers
    try:
        for call in (
            lambda: store.get([blocks[0].meta.block_hash]),
            lambda: store.contains([b"h"]),
        ):
            result, elapsed = timed(call)
            assert result in ([None], [False])
            assert elapsed < 1.0
        assert store.stats().errors == 1  # the second call was skipped by the backoff
    finally:
        server.resume()


def test_tier_resumes_after_restart_on_same_port(redis_server_factory, open_store) -> None:
    server = redis_server_factory()
    store = open_store(server.url, backoff_initial_s=0.1, backoff_max_s=0.3)
    server.stop()
    blocks = make_chain(NS, num_blocks=2)
    assert store.get([blocks[0].meta.block_hash]) == [None]
    assert store.stats().extra["available"] is False
    server.start()
    assert wait_until(
        lambda: store.contains([b"x" * 16]) == [False] and store.stats().extra["available"]
    )
    store.put(blocks)
    assert store.flush(5)
    for got, want in zip(store.get([b.meta.block_hash for b in blocks]), blocks, strict=True):
        assert_same_block(got, want)
    assert store.stats().extra["consecutive_failures"] == 0


def test_backoff_doubles_and_skips_the_network(redis_server_factory, open_store) -> None:
    server = redis_server_factory()
    store = open_store(server.url, backoff_initial_s=0.2, backoff_max_s=10)
    server.stop()
    store.contains([b"h"])
    first = store.stats()
    assert first.errors == 1 and 0.1 < first.extra["backoff_s"] <= 0.25
    store.contains([b"h"])
    assert store.stats().errors == 1 and store.stats().extra["skipped"] == 1
    time.sleep(first.extra["backoff_s"] + 0.05)
    store.contains([b"h"])  # the one probe after the backoff
    second = store.stats()
    assert second.errors == 2 and 0.3 < second.extra["backoff_s"] <= 0.45


def test_small_maxmemory_evicts_but_never_returns_wrong_data(
    redis_server_factory, open_store
) -> None:
    server = redis_server_factory(maxmemory="4mb")
    store = open_store(server.url)
    blocks = make_chain(NS, num_blocks=120, tokens_per_block=16, kv_heads=4, head_dim=128)
    assert sum(b.num_bytes for b in blocks) > 3 * 4 * 1024**2
    for i in range(0, len(blocks), 10):
        store.put(blocks[i : i + 10])
        assert store.flush(5)
    got = store.get([b.meta.block_hash for b in blocks])
    for g, want in zip(got, blocks, strict=True):
        if g is not None:
            assert_same_block(g, want)
    hits = [g is not None for g in got]
    assert 0 < sum(hits) < len(blocks)
    assert hits[-1] and not hits[0]  # LRU: the oldest went first
    assert store.stats().corrupt == 0
    assert store.stats().capacity_bytes == 4 * 1024**2


def test_seed_is_created_once_and_shared(redis_url: str, open_store) -> None:
    a, b = open_store(redis_url, "aaaa"), open_store(redis_url, "bbbb")
    assert a.seed(b"first") == b"first"
    assert b.seed(b"second") == b"first"
    raw = redis.Redis.from_url(redis_url)
    raw.delete(SEED_KEY)  # evicted: the next write batch restores the agreed seed
    a.put(make_chain("aaaa", num_blocks=1))
    assert a.flush(5)
    assert raw.get(SEED_KEY) == b"first"


def test_children_find_partial_tails_and_skip_evicted(redis_url: str, open_store) -> None:
    store = open_store(redis_url)
    parent = b"P" * 16
    full = make_block(NS, parent, np.arange(100, 116), seed=1)
    tail = make_block(NS, parent, np.arange(100, 105), seed=2)
    other = make_block(NS, b"Q" * 16, np.arange(7), seed=3)
    store.put([full, tail, other])
    assert store.flush(5)
    found = {m.block_hash: m for m in store.children(parent)}
    assert set(found) == {full.meta.block_hash, tail.meta.block_hash}
    assert found[tail.meta.block_hash].token_ids.tolist() == list(range(100, 105))
    assert found[full.meta.block_hash].parent_key == parent
    raw = redis.Redis.from_url(redis_url)
    raw.delete(store._key(full.meta.block_hash))  # as if Redis evicted it
    assert [m.block_hash for m in store.children(parent)] == [tail.meta.block_hash]
    assert raw.zcard(store._children_key(parent)) == 1  # dangling entry pruned
    assert store.children(b"Z" * 16) == []


def test_children_index_is_bounded(redis_url: str, open_store) -> None:
    store = open_store(redis_url)
    parent = b"P" * 16
    blocks = [make_block(NS, parent, np.array([i]), seed=i) for i in range(MAX_CHILDREN + 20)]
    store.put(blocks)
    assert store.flush(5)
    raw = redis.Redis.from_url(redis_url)
    assert raw.zcard(store._children_key(parent)) == MAX_CHILDREN
    assert len(store.children(parent)) == MAX_CHILDREN


def test_full_write_queue_drops_without_blocking(redis_url: str, open_store) -> None:
    blocks = make_chain(NS, num_blocks=20)
    store = open_store(redis_url, write_queue_bytes=2 * blocks[0].num_bytes)
    _, elapsed = timed(lambda: store.put(blocks))
    assert elapsed < 0.5
    assert store.flush(5)
    s = store.stats()
    assert s.writes_dropped >= 17 and s.blocks_written + s.writes_dropped == 20
    assert sum(x is not None for x in store.get([b.meta.block_hash for b in blocks])) == (
        s.blocks_written
    )


def test_credentials_in_url(redis_server_factory, open_store) -> None:
    server = redis_server_factory()
    admin = redis.Redis.from_url(server.url)
    admin.acl_setuser("alice", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])
    blocks = make_chain(NS, num_blocks=1)
    good = open_store(f"redis://alice:s3cret@127.0.0.1:{server.port}/0")
    good.put(blocks)
    assert good.flush(5) and good.stats().blocks_written == 1
    bad = open_store(f"redis://alice:wrong@127.0.0.1:{server.port}/0")
    assert bad.get([blocks[0].meta.block_hash]) == [None]
    assert bad.stats().errors == 1


def test_warns_once_about_a_non_lru_policy(redis_server_factory, open_store, caplog) -> None:
    server = redis_server_factory()
    redis.Redis.from_url(server.url).config_set("maxmemory-policy", "noeviction")
    with caplog.at_level(logging.WARNING, logger="pagedkv.storage.redis"):
        store = open_store(server.url)
        store.put(make_chain(NS, num_blocks=2))
        assert store.flush(5)
        store.put(make_chain(NS, num_blocks=2, seed=5))
        assert store.flush(5)
    assert sum("allkeys-lru" in r.getMessage() for r in caplog.records) == 1
