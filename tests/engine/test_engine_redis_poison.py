"""Poisoned Redis values (random bytes, truncated, numbers made `1e999`, flipped bytes)
are misses: the output equals the cache off, the lookup keeps what RAM matched,
nothing fails, and no RAM block stays referenced."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import redis as redis_py
from engine_helpers import BS, GREEDY, random_prompt, reference_outputs

from pagedkv import CacheConfig, Engine
from pagedkv.storage.redis.format import decode_frame
from pagedkv.storage.redis.store import SEED_KEY

pytestmark = pytest.mark.redis

SHARED = random_prompt(41, 3 * BS)
PROMPTS = [SHARED + random_prompt(42, 3), SHARED + random_prompt(43, 4 * BS + 3)]


def _flip(value: bytes) -> bytes:
    return bytes(b ^ 0x5A if i % 97 == 3 else b for i, b in enumerate(value))


def _overflow(value: bytes) -> bytes:
    """The token count in the header made `1e999`, the header's length field kept true."""
    (size,) = struct.unpack_from("<I", value, 8)
    header = re.sub(rb'"n":\d+', b'"n":1e999', value[12 : 12 + size], count=1)
    return value[:8] + struct.pack("<I", len(header)) + header + value[12 + size :]


POISON: dict[str, Callable[[bytes], bytes]] = {
    "random bytes": lambda v: np.random.default_rng(len(v)).bytes(len(v)),
    "truncated": lambda v: v[: len(v) // 2],
    "1e999": _overflow,
    "flipped bytes": _flip,
}


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> list[list[int]]:
    return reference_outputs(tiny_llama_dir, PROMPTS)


@pytest.mark.parametrize("kind", list(POISON))
def test_poisoned_values_are_misses(
    tiny_llama_dir: Path, redis_url: str, reference: list[list[int]], kind: str
) -> None:
    cfg = CacheConfig(block_size=BS, redis_url=redis_url)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as first:
        for prompt, want in zip(PROMPTS, reference, strict=True):
            assert first.generate(prompt, GREEDY).token_ids == want
        assert first.prefix is not None and first.prefix.lower.flush(10)
    client = redis_py.Redis.from_url(redis_url)
    poisoned = 0
    for key in client.scan_iter("pagedkv:*"):
        if client.type(key) == b"string" and key != SEED_KEY.encode():
            value = client.get(key)
            assert value is not None
            bad = POISON[kind](value)
            assert bad != value
            client.set(key, bad)
            poisoned += 1
    assert poisoned >= 7
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as eng:
        # The first request meets poison for SHARED, recomputes it, keeps it in RAM.
        a = eng.generate(PROMPTS[0], GREEDY)
        # The second matches SHARED in RAM and meets poison for the rest.
        b = eng.generate(PROMPTS[1], GREEDY)
        assert [a.token_ids, b.token_ids] == reference
        assert a.cached_tokens == 0
        assert b.cached_tokens == len(SHARED)
        stats = eng.cache_stats()
        assert stats.scheduling is not None
        assert stats.scheduling.cache_errors == 0, "a bad value is a miss, not a failed lookup"
        assert stats.cache is not None
        assert stats.cache.tiers["redis"].corrupt > 0
        assert stats.cache.tiers["redis"].hits == 0
        assert stats.cache.pool.allocated == 0, "a RAM block is still referenced"
        assert eng.prefix is not None
        eng.prefix.pool.check()


def test_engines_with_one_secret_share_and_a_forged_frame_is_refused(
    tiny_llama_dir: Path, redis_url: str, reference: list[list[int]]
) -> None:
    secret = "the engines' shared secret, 32 b"
    cfg = CacheConfig(block_size=BS, redis_url=redis_url, cache_secret=secret)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as first:
        assert first.generate(PROMPTS[1], GREEDY).token_ids == reference[1]
        assert first.prefix is not None and first.prefix.lower.flush(10)
    client = redis_py.Redis.from_url(redis_url)
    assert not client.exists(SEED_KEY), "the derived seed is never stored"
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as second:
        r = second.generate(PROMPTS[1], GREEDY)
        assert r.token_ids == reference[1] and r.tier_hits.get("redis", 0) > 0
        assert second.prefix is not None
        tier = second.prefix.lower.tiers[0]
        chain = second.prefix.hasher.chain(PROMPTS[0])
    # A writer without the secret re-signs nothing: it stores frames with valid checksums.
    for key in client.scan_iter("pagedkv:*"):
        if client.type(key) == b"string":
            value = client.get(key)
            assert value is not None
            header_len = struct.unpack_from("<I", value, 8)[0]
            header = value[12 : 12 + header_len]
            forged = re.sub(rb',"m":"[0-9a-f]+"', b"", header)
            forged += b" " * (len(header) - len(forged))
            client.set(key, value[:12] + forged + value[12 + header_len :])
    forged_value = client.get(tier._key(chain.hashes[0]))
    assert decode_frame(forged_value, chain.hashes[0], tier.namespace) is not None, (
        "the forgery is a valid frame for an engine without the secret"
    )
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as third:
        r = third.generate(PROMPTS[1], GREEDY)
        assert r.token_ids == reference[1] and r.cached_tokens == 0
        stats = third.cache_stats().cache
        assert stats is not None
        assert stats.tiers["redis"].extra["mac_failures"] > 0
        assert stats.pool.allocated == 0
