"""Clearing one model's cache on shared stores leaves every other model's blocks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis as redis_py
from engine_helpers import BS, GREEDY, random_prompt

from pagedkv import CacheConfig, Engine, SamplingParams
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


def test_requests_keep_decoding_while_the_lower_tiers_clear(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=tmp_path / "kv", ssd_cache_bytes=64 * 2**20)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as engine:
        assert engine.prefix is not None
        engine.generate(random_prompt(1, 40), GREEDY)
        ssd = next(t for t in engine.prefix.lower.tiers if t.name == "ssd")
        entered, release = threading.Event(), threading.Event()
        cleared: list[str] = []
        real_clear = ssd.clear

        def slow_clear(namespace: str) -> int:  # a big directory, or a slow Redis
            entered.set()
            release.wait(10.0)
            cleared.append(namespace)
            return real_clear(namespace)

        monkeypatch.setattr(ssd, "clear", slow_clear)
        tokens: list[int] = []
        stream = engine.stream(
            random_prompt(2, 20), SamplingParams(max_tokens=3000, ignore_eos=True)
        )

        def read() -> None:
            for event in stream:
                tokens.extend(event.token_ids)

        reader = threading.Thread(target=read)
        reader.start()
        _wait(lambda: len(tokens) >= 2)
        clearer = threading.Thread(target=engine.clear_cache)
        clearer.start()
        assert entered.wait(10.0)
        before = len(tokens)
        try:
            assert _wait(lambda: len(tokens) >= before + 20), "decoding stopped during the clear"
        finally:
            release.set()
            clearer.join(20.0)
            stream.cancel()
            reader.join(20.0)
        assert cleared == [engine.prefix.namespace]
        again = engine.generate(random_prompt(1, 40), GREEDY)
        assert again.cached_tokens == 0  # gone from RAM and SSD alike


def _wait(done: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
