"""The flood workload at tiny size: a leased prefix survives 20x the RAM tier of other
traffic; without a lease (and no SSD) it does not."""

from __future__ import annotations

from pathlib import Path

from pagedkv.bench.flood import SHAPES, format_flood, run_flood
from pagedkv.config import CacheConfig


def test_a_leased_prefix_survives_the_flood_and_an_unleased_one_does_not(
    tiny_llama_dir: Path,
) -> None:
    from pagedkv.model import load_model

    adapter = load_model(str(tiny_llama_dir), device="cpu", dtype="float32")
    result = run_flood(adapter, "tiny", CacheConfig(block_size=8), seed=0)
    leased, unleased = result["runs"]
    shape = SHAPES["tiny"]
    assert leased["lease"] and not unleased["lease"]
    assert leased["flood_tokens"] >= shape.multiple * shape.ram_tokens
    assert leased["undisturbed_cached_tokens"] >= shape.prefix_tokens // 8 * 8
    assert leased["after_reusable_reuse"] >= 0.98 and result["meets_reuse_target"]
    assert leased["after_tier_hits"].get("ram", 0) >= shape.prefix_tokens // 8 * 8
    assert unleased["after_prefix_reuse"] < 0.5  # RAM only: the flood evicted it
    text = format_flood(result)
    assert "leased  : cached" in text and "unleased: cached" in text
