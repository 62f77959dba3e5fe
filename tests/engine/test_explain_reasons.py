"""Explain's causes beyond new/diverged/evicted, on real engines (tiny models), and that
its `cached_tokens` is what the request it explains then reuses, for every model kind:
plain attention, sliding window, recurrent hybrid (which resumes only at block
boundaries with a state snapshot), from RAM and from SSD after a restart."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from engine_helpers import GREEDY, random_prompt
from fixtures_models import make_tiny_model

from pagedkv import CacheConfig, Engine
from pagedkv.cache.explain import REASONS

BS = 4
KINDS = {
    "plain": ("llama", {}),
    "sliding": ("mistral", {"sliding_window": 16}),
    "hybrid": ("lfm2", {}),
}


@pytest.fixture(scope="module", params=list(KINDS))
def kind_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, overrides = KINDS[request.param]
    path = tmp_path_factory.mktemp(f"explain-{request.param}") / request.param
    return make_tiny_model(path, arch=arch, seed=11, **overrides)


def _variants(base: list[int]) -> list[list[int]]:
    """Prompts that share with `base`: less than a block, a few blocks and a bit,
    exactly whole blocks, all of it plus more."""
    out = []
    for shared in (BS - 1, 3 * BS + 2, 4 * BS, len(base)):
        tail = [t + 1 if t < 500 else 3 for t in base[shared : shared + 1]]  # differs at once
        out.append(base[:shared] + tail + random_prompt(900 + shared, 2 * BS + 1))
    return out


def test_cached_tokens_equal_what_the_request_reuses(kind_model: Path) -> None:
    base = random_prompt(77, 8 * BS + 3)
    with Engine.from_pretrained(str(kind_model), config=CacheConfig(block_size=BS)) as eng:
        assert eng.prefix is not None, eng.cache_stats().caching_off_reason
        eng.generate(base, GREEDY)
        for prompt in [base, *_variants(base)]:
            exp = eng.explain(prompt)
            got = eng.generate(prompt, GREEDY)
            assert exp.cached_tokens == got.cached_tokens, (kind_model.name, len(prompt), exp)
            if exp.miss is not None:
                assert exp.miss.token_index == exp.cached_tokens
                assert exp.miss.reason in REASONS


def test_cached_tokens_equal_the_reuse_after_a_restart_from_ssd(
    kind_model: Path, tmp_path: Path
) -> None:
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=tmp_path / "kv", ssd_cache_bytes=2**26)
    base = random_prompt(78, 8 * BS + 3)
    with Engine.from_pretrained(str(kind_model), config=cfg) as eng:
        eng.generate(base, GREEDY)
    for prompt in _variants(base):
        with Engine.from_pretrained(str(kind_model), config=cfg) as eng:
            exp = eng.explain(prompt)
            got = eng.generate(prompt, GREEDY)
        assert exp.cached_tokens == got.cached_tokens, (kind_model.name, exp)
        assert exp.tiers["ssd"] == got.tier_hits.get("ssd", 0)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("explain-lfm2") / "lfm2", arch="lfm2", seed=3)


def test_hybrid_shared_part_below_a_block_is_below_block(hybrid_model: Path) -> None:
    # The case: a shared part shorter than a block was reported as cached,
    # while the request, which resumes only at a block boundary, reused nothing.
    base = random_prompt(80, 4 * BS)
    other = base[: BS - 2] + random_prompt(81, 2 * BS)
    with Engine.from_pretrained(str(hybrid_model), config=CacheConfig(block_size=BS)) as eng:
        eng.generate(base, GREEDY)
        exp = eng.explain(other)
        assert exp.cached_tokens == 0 and exp.miss is not None
        assert (exp.miss.token_index, exp.miss.reason) == (0, "below_block")
        assert f"next {BS - 2} tokens" in exp.miss.detail
        assert eng.generate(other, GREEDY).cached_tokens == 0


def test_hybrid_without_its_snapshot_is_snapshot_missing(hybrid_model: Path) -> None:
    # Snapshots every 3 blocks: a prompt sharing 5 blocks has their KV but the state
    # only at block 3.
    cfg = CacheConfig(block_size=BS, snapshot_interval_blocks=3)
    base = random_prompt(82, 7 * BS)
    other = base[: 5 * BS] + random_prompt(83, 2 * BS)
    with Engine.from_pretrained(str(hybrid_model), config=cfg) as eng:
        eng.generate(base, GREEDY)
        exp = eng.explain(other)
        got = eng.generate(other, GREEDY)
        assert exp.miss is not None and exp.miss.reason == "snapshot_missing"
        assert exp.cached_tokens == got.cached_tokens == 3 * BS
        assert exp.miss.token_index == 3 * BS
        assert "snapshot" in exp.miss.detail


def test_other_tenant_only_when_the_caller_may_know(tiny_llama_dir: Path) -> None:
    prompt = random_prompt(84, 5 * BS + 1)
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as eng:
        eng.generate(prompt, GREEDY, cache_salt="owner")
        plain = eng.explain(prompt, cache_salt="admin")
        assert plain.miss is not None and plain.miss.reason == "new"
        told = eng.explain(prompt, cache_salt="admin", other_salts=["owner", "someone"])
        assert told.miss is not None and told.miss.reason == "other_tenant"
        assert told.cached_tokens == 0 and "owner" not in told.miss.detail
        # A prompt the owner never sent: new, whoever asks.
        fresh = eng.explain(random_prompt(85, 3 * BS), cache_salt="admin", other_salts=["owner"])
        assert fresh.miss is not None and fresh.miss.reason == "new"
        # Past the shared part only: the owner's prompt diverges inside a block.
        mixed = prompt[: 2 * BS + 1] + random_prompt(86, 2 * BS)
        eng.generate(mixed, GREEDY, cache_salt="admin")
        longer = prompt[: 3 * BS + 2] + random_prompt(87, BS)
        exp = eng.explain(longer, cache_salt="admin", other_salts=["owner"])
        assert exp.miss is not None and exp.miss.token_index == 2 * BS + 1
        assert exp.miss.reason == "other_tenant"


def test_identity_changed_names_what_changed(tiny_llama_dir: Path, tmp_path: Path) -> None:
    prompt = random_prompt(88, 6 * BS)
    common = {"block_size": BS, "ssd_cache_dir": tmp_path / "kv", "ssd_cache_bytes": 2**26}
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(**common)) as first:
        first.generate(prompt, GREEDY, cache_salt="t")
        assert first.prefix is not None
        first.prefix.lower.flush(10)
    int8 = CacheConfig(**common, kv_dtype="int8")
    with Engine.from_pretrained(str(tiny_llama_dir), config=int8) as second:
        exp = second.explain(prompt, cache_salt="t")
        assert exp.miss is not None and exp.miss.reason == "identity_changed", exp
        assert exp.cached_tokens == 0 and "kv_dtype" in exp.miss.detail
        # Another tenant's salt finds nothing under the other namespace either.
        other = second.explain(prompt, cache_salt="u")
        assert other.miss is not None and other.miss.reason == "new"
        assert second.generate(prompt, GREEDY, cache_salt="t").cached_tokens == 0


def test_identity_changed_on_redis(tiny_llama_dir: Path, redis_url: str) -> None:
    prompt = random_prompt(89, 6 * BS)
    cfg = CacheConfig(block_size=BS, redis_url=redis_url)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as first:
        first.generate(prompt, GREEDY)
        assert first.prefix is not None and first.prefix.lower.flush(10)
    int8 = CacheConfig(block_size=BS, redis_url=redis_url, kv_dtype="int8")
    with Engine.from_pretrained(str(tiny_llama_dir), config=int8) as second:
        exp = second.explain(prompt)
        assert exp.miss is not None and exp.miss.reason == "identity_changed", exp
        assert "redis holds" in exp.miss.detail and "kv_dtype" in exp.miss.detail
        assert second.generate(prompt, GREEDY).cached_tokens == 0


def test_sliding_window_part_lost_on_ssd_cuts_what_explain_reports(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "gemma", arch="gemma3_text", seed=7)
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=tmp_path / "kv", ssd_cache_bytes=2**26)
    base = random_prompt(90, 12 * BS + 1)
    with Engine.from_pretrained(str(model), config=cfg) as eng:
        eng.generate(base, GREEDY)
    with Engine.from_pretrained(str(model), config=cfg) as eng:
        assert eng.prefix is not None and eng.prefix.split is not None
        chain = eng.prefix.hasher.chain(base)
        ssd = eng.prefix.lower.tiers[0]
        ssd.remove([eng.prefix.split.part_key(chain.hashes[10])])  # inside the last window
        exp = eng.explain(base)
        got = eng.generate(base, GREEDY)
    assert exp.cached_tokens == got.cached_tokens == 10 * BS
    assert exp.miss is not None and (exp.miss.token_index, exp.miss.reason) == (10 * BS, "evicted")
    assert "sliding-window" in exp.miss.detail


def test_requests_misses_are_counted_while_their_attribution_is_logged(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = random_prompt(91, 3 * BS + 1)
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as eng:
        with caplog.at_level(logging.DEBUG, logger="pagedkv.engine.worker"):
            eng.generate(prompt, GREEDY)  # new
            eng.generate(prompt, GREEDY)  # a whole hit: no miss
            eng.generate(prompt[:BS] + random_prompt(92, BS), GREEDY)  # diverged
        assert eng.cache_stats().request_misses == {"new": 1, "diverged": 1}
        eng.generate(random_prompt(93, BS), GREEDY)  # not logged, not counted
        assert eng.cache_stats().request_misses == {"new": 1, "diverged": 1}


def test_other_tenant_shows_nothing_of_the_other_tenants_prompt(tiny_llama_dir: Path) -> None:
    words = [377, 424, 426, 428, 487]  # 'hello', 'Blocks', ...: in no digit prompt
    digits = [18 + (i * 7) % 10 for i in range(3 * BS + 2)]
    owner = digits + words * 2
    asked = digits + [18 + (i * 3) % 10 for i in range(2 * BS)]
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as eng:
        eng.generate(owner, GREEDY, cache_salt="owner")
        exp = eng.explain(asked, cache_salt="admin", other_salts=["owner"])
        assert exp.miss is not None and exp.miss.reason == "other_tenant"
        text = json.dumps(exp.to_json())
        for t in words:
            assert eng.decode([t]) not in text
        assert "[" not in text.replace('"tiers": {', "")  # no list of token ids anywhere
