"""Clearing one model's cache on shared stores leaves every other model's blocks."""

from __future__ import annotations

from pathlib import Path

import redis as redis_py
from engine_helpers import BS, GREEDY, random_prompt

from pagedkv import CacheConfig, Engine
from pagedkv.storage.ssd import cache_stats


def _redis_namespaces(url: str) -> dict[str, int]:
    client = redis_py.Redis.from_url(url)
    counts: dict[str, int] = {}
    for key in client.scan_iter(match="pagedkv:*"):
        parts = key.decode().split(":")
        if len(parts) >= 3:
            counts[parts[1]] = counts.get(parts[1], 0) + 1
    return counts


def test_clear_removes_only_this_models_blocks_from_ssd_and_redis(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    ssd = tmp_path / "kv"
    cfg = CacheConfig(
        block_size=BS, ssd_cache_dir=ssd, ssd_cache_bytes=64 * 2**20, redis_url=redis_url
    )
    prompt = random_prompt(5, 40)
    with (
        Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as llama,
        Engine.from_pretrained(str(tiny_qwen2_dir), config=cfg) as qwen,
    ):
        llama.generate(prompt, GREEDY)
        qwen.generate(prompt, GREEDY)
        assert llama.prefix is not None and qwen.prefix is not None
        llama.prefix.lower.flush(10.0)
        qwen.prefix.lower.flush(10.0)
        mine, theirs = llama.prefix.namespace, qwen.prefix.namespace
        assert mine != theirs
        on_disk = cache_stats(ssd).namespaces
        in_redis = _redis_namespaces(redis_url)
        assert on_disk[mine].num_blocks > 0 and on_disk[theirs].num_blocks > 0
        assert in_redis[mine] > 0 and in_redis[theirs] > 0

        llama.clear_cache()

        on_disk_after = cache_stats(ssd).namespaces
        assert mine not in on_disk_after or on_disk_after[mine].num_blocks == 0
        assert on_disk_after[theirs].num_blocks == on_disk[theirs].num_blocks
        in_redis_after = _redis_namespaces(redis_url)
        assert mine not in in_redis_after
        assert in_redis_after[theirs] == in_redis[theirs]
        assert llama.cache_stats().cache.pool.cached == 0  # type: ignore[union-attr]
        # the other model still hits, from RAM and below
        again = qwen.generate(prompt, GREEDY)
        assert again.cached_tokens == len(prompt) - 1
