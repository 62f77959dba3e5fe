"""Faults that outlast their cause, on the Redis side: another format version's values
are left alone, and a clock step does not reorder the children index."""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis
from fixtures_redis import make_block, make_chain
from test_redis import assert_same_block

from pagedkv.storage.redis.store import MAX_CHILDREN, RedisStore

pytestmark = pytest.mark.redis

NS = "0123abcd"


def test_another_format_version_keeps_its_values(redis_url: str) -> None:
    """A rolling upgrade: engines of the old and the new frame version share one Redis.
    Neither overwrites nor deletes the other's values (their keys differ)."""
    store = RedisStore(redis_url, NS)
    try:
        block = make_chain(NS, num_blocks=1)[0]
        h = block.meta.block_hash.hex()
        raw = redis.Redis.from_url(redis_url)
        theirs = {
            f"pagedkv:{NS}:{h}": b"PKVR\x01\0\0\0" + b"an older engine's frame",
            f"pagedkv:{NS}:v9:{h}": b"PKVR\x09\0\0\0" + b"a newer engine's frame",
        }
        for key, value in theirs.items():
            raw.set(key, value)
        store.put([block])
        assert store.flush(5)
        assert store._key(block.meta.block_hash) not in theirs
        assert_same_block(store.get([block.meta.block_hash])[0], block)
        assert store.children(block.meta.parent_key)[0].block_hash == block.meta.block_hash
        for key, value in theirs.items():
            assert raw.get(key) == value, f"{key} was overwritten or deleted"
        assert store.stats().corrupt == 0
        assert store.clear(NS) >= 2  # clearing the model clears every version of it
        assert not any(raw.exists(k) for k in theirs)
    finally:
        store.close()


def test_a_clock_stepped_back_keeps_the_newest_children(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisStore(redis_url, NS)
    try:
        parent = b"P" * 16
        old = [make_block(NS, parent, np.array([i]), seed=i) for i in range(MAX_CHILDREN)]
        store.put(old)
        assert store.flush(5)
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 86_400)  # NTP steps back a day
        new = [make_block(NS, parent, np.array([1000 + i]), seed=1000 + i) for i in range(5)]
        for block in new:  # one write batch each, in this order
            store.put([block])
            assert store.flush(5)
        got = [m.block_hash for m in store.children(parent)]
        assert len(got) == MAX_CHILDREN
        assert got[:5] == [b.meta.block_hash for b in reversed(new)], "newest first"
        assert set(got[5:]) == {b.meta.block_hash for b in old[5:]}, "the oldest were trimmed"
    finally:
        store.close()
