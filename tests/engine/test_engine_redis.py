"""Engines sharing one Redis: reuse across processes, and Redis faults never fail a request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import redis as redis_py
from engine_helpers import BS, GREEDY, random_prompt, reference_outputs, run_worker

from pagedkv import CacheConfig, Engine


def test_second_engine_in_another_process_reuses_blocks(
    tiny_llama_dir: Path, redis_url: str
) -> None:
    shared = random_prompt(1, 40)
    prompts = [shared + random_prompt(2, 6), shared + random_prompt(3, 9)]
    want = reference_outputs(tiny_llama_dir, prompts)
    cfg = CacheConfig(block_size=BS, redis_url=redis_url)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as first:
        assert first.generate(prompts[0], GREEDY).token_ids == want[0]
    # another process: empty RAM, no SSD, the seed comes from Redis
    *results, stats = run_worker(
        tiny_llama_dir, {"block_size": BS, "redis_url": redis_url}, prompts
    )
    assert [r["token_ids"] for r in results] == want
    assert results[0]["cached_tokens"] == len(prompts[0]) - 1
    assert results[0]["tier_hits"].get("redis", 0) > 0
    assert results[1]["cached_tokens"] >= len(shared)
    assert stats["stats"]["cache"]["tiers"]["redis"]["hits"] > 0


def test_engines_share_blocks_through_a_redis_cluster(
    tiny_llama_dir: Path, redis_cluster_url: str
) -> None:
    shared = random_prompt(11, 48)
    prompts = [shared + random_prompt(12, 5), shared + random_prompt(13, 7)]
    want = reference_outputs(tiny_llama_dir, prompts)
    cache = {"block_size": BS, "redis_url": redis_cluster_url, "redis_cluster": True}
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(**cache)) as first:
        assert first.generate(prompts[0], GREEDY).token_ids == want[0]
    *results, stats = run_worker(tiny_llama_dir, cache, prompts)  # empty RAM, no SSD
    assert [r["token_ids"] for r in results] == want
    assert results[0]["cached_tokens"] == len(prompts[0]) - 1
    assert results[1]["cached_tokens"] >= len(shared)
    redis_stats = stats["stats"]["cache"]["tiers"]["redis"]
    assert redis_stats["hits"] > 0 and redis_stats["errors"] == 0


def test_redis_killed_mid_run_never_fails_or_stalls(
    tiny_llama_dir: Path, redis_server_factory: Any
) -> None:
    server = redis_server_factory()
    prompts = [random_prompt(10 + i, 30 + 5 * i) for i in range(6)]
    want = reference_outputs(tiny_llama_dir, prompts)
    cfg = CacheConfig(block_size=BS, redis_url=server.url)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as eng:
        base = eng.generate(prompts[0], GREEDY)
        assert base.token_ids == want[0]
        server.stop()
        for prompt, expected in zip(prompts[1:], want[1:], strict=True):
            t = time.perf_counter()
            r = eng.generate(prompt, GREEDY)
            assert r.token_ids == expected
            assert time.perf_counter() - t < base.total_s + 1.0
        assert eng.cache_stats().cache.tiers["redis"].errors > 0
        # Redis back on the same port: the tier resumes without a new engine.
        server.start()
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            eng.generate(random_prompt(int(time.monotonic() * 1000), 20), GREEDY)
            eng.prefix.lower.flush(5.0)  # type: ignore[union-attr]
            if redis_py.Redis.from_url(server.url).dbsize() > 1:
                break
            time.sleep(0.5)
        assert redis_py.Redis.from_url(server.url).dbsize() > 1, "the Redis tier did not resume"


def test_corrupted_values_are_misses(tiny_llama_dir: Path, redis_url: str) -> None:
    prompt = random_prompt(20, 50)
    want = reference_outputs(tiny_llama_dir, [prompt])[0]
    cfg = CacheConfig(block_size=BS, redis_url=redis_url)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as eng:
        eng.generate(prompt, GREEDY)
    client = redis_py.Redis.from_url(redis_url)
    for key in client.scan_iter("pagedkv:*"):
        if client.type(key) == b"string" and key != b"pagedkv:seed":
            value = bytearray(client.get(key))
            value[-1] ^= 0xFF
            client.set(key, bytes(value))
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as eng:
        r = eng.generate(prompt, GREEDY)
        assert r.token_ids == want
        assert r.cached_tokens == 0
        assert eng.cache_stats().cache.tiers["redis"].corrupt > 0


def test_small_maxmemory_lru_stays_correct(tiny_llama_dir: Path, redis_server_factory: Any) -> None:
    server = redis_server_factory(maxmemory="2mb")
    prompts = [random_prompt(30 + i, 120) for i in range(8)]
    want = reference_outputs(tiny_llama_dir, prompts)
    cfg = CacheConfig(block_size=BS, redis_url=server.url)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as eng:
        for p in prompts:
            eng.generate(p, GREEDY)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as eng:
        got = [eng.generate(p, GREEDY).token_ids for p in prompts]
    assert got == want
