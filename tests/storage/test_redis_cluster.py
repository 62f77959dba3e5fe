"""RedisStore on a real three-node Redis Cluster: blocks spread over the shards,
every operation spans them, and the cluster's faults cost misses as a single
server's do."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from fixtures_redis import RedisServer, form_cluster, make_block, make_chain, start_redis_cluster

from pagedkv.storage.redis.store import RedisStore

pytestmark = pytest.mark.redis

NS = "0123abcd"


@pytest.fixture
def open_store() -> Iterator[Callable[..., RedisStore]]:
    stores: list[RedisStore] = []

    def factory(url: str, namespace: str = NS, **kwargs: object) -> RedisStore:
        kwargs.setdefault("cluster", True)
        stores.append(RedisStore(url, namespace, **kwargs))  # type: ignore[arg-type]
        return stores[-1]

    yield factory
    for store in stores:
        store.close()


def keys_per_node(nodes: list[RedisServer]) -> list[int]:
    return [int(redis.Redis(port=n.port).dbsize()) for n in nodes]


def same(got: object, want: object) -> bool:
    assert got is not None and want is not None
    return bool(
        got.meta.block_hash == want.meta.block_hash  # type: ignore[attr-defined]
        and np.array_equal(got.meta.token_ids, want.meta.token_ids)  # type: ignore[attr-defined]
        and torch.equal(got.kv, want.kv)  # type: ignore[attr-defined]
    )


def test_blocks_spread_over_the_shards_and_round_trip(
    redis_cluster_url: str, redis_cluster_nodes: list[RedisServer], open_store
) -> None:
    admins = [redis.Redis(port=n.port) for n in redis_cluster_nodes]
    for admin in admins:
        admin.config_set("maxmemory", 64 * 2**20)
    store = open_store(redis_cluster_url)
    chain = make_chain(NS, 24)
    store.put(chain)
    assert store.flush(10)
    for admin in admins:
        admin.config_set("maxmemory", 0)
        admin.close()
    assert store.stats().capacity_bytes == 3 * 64 * 2**20  # the sum over the primaries
    per_node = keys_per_node(redis_cluster_nodes)
    assert all(n > 0 for n in per_node), per_node  # 24 blocks + their children sets
    hashes = [b.meta.block_hash for b in chain]
    got = store.get([*hashes, b"\x00" * 16])
    assert got[-1] is None
    assert all(same(g, b) for g, b in zip(got, chain, strict=False))
    assert store.contains([*hashes[:3], b"\x01" * 16]) == [True, True, True, False]
    store.remove(hashes[:12])
    assert store.contains(hashes) == [False] * 12 + [True] * 12
    stats = store.stats()
    assert stats.hits == 24 and stats.errors == 0 and stats.location.startswith("cluster ")


def test_children_and_clear_span_the_shards(
    redis_cluster_url: str, redis_cluster_nodes: list[RedisServer], open_store
) -> None:
    store = open_store(redis_cluster_url)
    other = open_store(redis_cluster_url, namespace="ffff0000")
    parent = b"p" * 16
    tails = [make_block(NS, parent, np.arange(i + 1, dtype=np.int32), seed=i) for i in range(6)]
    store.put(tails + make_chain(NS, 12))
    other.put(make_chain("ffff0000", 9))
    assert store.flush(10) and other.flush(10)
    children = store.children(parent)
    assert {c.block_hash for c in children} == {t.meta.block_hash for t in tails}
    assert children[0].block_hash == tails[-1].meta.block_hash  # newest first
    # 6 tails + 12 blocks, their 1 + 12 children sets
    assert store.clear(NS) == 6 + 12 + 1 + 12
    assert store.children(parent) == []
    assert sum(keys_per_node(redis_cluster_nodes)) == 9 + 9  # the other namespace's, all kept
    kept = other.get([b.meta.block_hash for b in make_chain("ffff0000", 9)])
    assert all(b is not None for b in kept)


def test_a_bad_value_on_a_shard_is_a_miss_and_is_deleted(
    redis_cluster_url: str, open_store
) -> None:
    store = open_store(redis_cluster_url)
    chain = make_chain(NS, 6)
    store.put(chain)
    assert store.flush(10)
    client = redis.RedisCluster.from_url(redis_cluster_url)
    key = f"pagedkv:{NS}:v2:{chain[3].meta.block_hash.hex()}"
    assert client.exists(key)
    client.set(key, b"not a frame")
    got = store.get([b.meta.block_hash for b in chain])
    assert [g is None for g in got] == [False, False, False, True, False, False]
    assert not client.exists(key)
    assert store.stats().corrupt == 1
    client.close()


def test_a_cluster_down_at_start_costs_misses_then_serves(open_store) -> None:
    with start_redis_cluster(wait=False) as nodes:
        store = open_store(nodes[0].url, backoff_initial_s=0.2, backoff_max_s=0.2)
        chain = make_chain(NS, 4)
        start = time.monotonic()
        assert store.get([b.meta.block_hash for b in chain]) == [None] * 4
        assert store.contains([chain[0].meta.block_hash]) == [False]
        store.put(chain)  # dropped: the tier is backing off
        assert time.monotonic() - start < 2.0
        assert store.stats().errors >= 1
        form_cluster(nodes)
        deadline = time.monotonic() + 10
        while not store.contains([chain[0].meta.block_hash])[0]:
            assert time.monotonic() < deadline, "the store never used the cluster"
            store.put(chain)
            store.flush(5)
            time.sleep(0.1)
        got = store.get([b.meta.block_hash for b in chain])
        assert all(same(g, b) for g, b in zip(got, chain, strict=True))


def test_a_cluster_node_used_as_a_single_server_warns(
    redis_cluster_url: str, open_store, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pagedkv.storage.redis"):
        store = open_store(redis_cluster_url, cluster=False)
        store.put(make_chain(NS, 1))
        store.flush(10)
    assert any("--redis-cluster" in r.getMessage() for r in caplog.records)


def test_the_acl_user_of_docs_security_is_enough_on_a_cluster(
    redis_cluster_url: str, redis_cluster_nodes: list[RedisServer], open_store
) -> None:
    """docs/security.md's user, with the rules it adds for a cluster, on every node."""
    doc = (Path(__file__).parents[2] / "docs" / "security.md").read_text()
    lines = [line.strip() for line in doc.splitlines() if "ACL SETUSER pagedkv" in line]
    rules = [lines[0].split(), next(line for line in lines if "cluster|slots" in line).split()]
    admins = [redis.Redis(port=node.port) for node in redis_cluster_nodes]
    try:
        for admin in admins:
            for rule in rules:
                admin.execute_command(*rule)
            admin.execute_command("ACL", "SETUSER", "pagedkv", ">pw-123")  # doc: a placeholder
        port = redis_cluster_nodes[0].port
        store = open_store(f"redis://pagedkv:pw-123@127.0.0.1:{port}/0")
        parent = b"P" * 16
        tokens = [np.arange(i + 1, dtype=np.int32) for i in range(3)]
        blocks = [make_block(NS, parent, t, seed=i) for i, t in enumerate(tokens)]
        store.put(blocks + make_chain(NS, 6))
        assert store.flush(5)
        assert store.contains([b.meta.block_hash for b in blocks]) == [True] * 3
        assert all(g is not None for g in store.get([b.meta.block_hash for b in blocks]))
        assert len(store.children(parent)) == 3
        assert store.clear(NS) == 3 + 6 + 1 + 6
        s = store.stats()
        assert (s.errors, s.writes_dropped, s.blocks_written) == (0, 0, 9)
    finally:
        for admin in admins:
            admin.execute_command("ACL", "DELUSER", "pagedkv")
            admin.close()
