"""Explaining a lookup on a real engine (tiny model): new, diverged at the right token,
evicted by capacity and by a clear, another tenant; and that explaining changes nothing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import BS, GREEDY, random_prompt

from pagedkv import CacheConfig, Engine
from pagedkv.cache.history import CacheHistory


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as e:
        yield e


def test_new_then_hit_then_diverged_at_the_first_differing_token(engine: Engine) -> None:
    prompt = random_prompt(100, 5 * BS + 3)
    first = engine.explain(prompt, cache_salt="t1")
    assert first.cached_tokens == 0 and first.miss is not None
    assert (first.miss.token_index, first.miss.reason) == (0, "new")
    result = engine.generate(prompt, GREEDY, cache_salt="t1")
    again = engine.explain(prompt, cache_salt="t1")
    # What a request sent now reuses: the same as a real second request.
    second = engine.generate(prompt, GREEDY, cache_salt="t1")
    assert again.cached_tokens == second.cached_tokens == len(prompt) - 1
    assert again.miss is None and again.tiers["ram"] == again.cached_tokens
    assert result.token_ids == second.token_ids
    at = 2 * BS + 5
    other = [*prompt[:at], 250, 251, 252, *prompt[at + 3 :]]
    exp = engine.explain(other, cache_salt="t1")
    assert exp.cached_tokens == at  # a request would reuse exactly the shared tokens
    assert exp.miss is not None and (exp.miss.token_index, exp.miss.reason) == (at, "diverged")
    # Both sides, as text: this prompt's next tokens, and the earlier one's to its block end.
    assert f"continues {engine.decode(other[at : at + 8])!r}" in exp.miss.detail
    assert f"the earlier one {engine.decode(prompt[at : 3 * BS])!r}" in exp.miss.detail
    assert engine.generate(other, GREEDY, cache_salt="t1").cached_tokens == at


def test_another_tenant_learns_nothing(engine: Engine) -> None:
    prompt = random_prompt(101, 4 * BS)
    engine.generate(prompt, GREEDY, cache_salt="owner")
    assert engine.explain(prompt, cache_salt="owner").miss is None
    stranger = engine.explain(prompt, cache_salt="stranger")
    assert stranger.cached_tokens == 0 and stranger.miss is not None
    assert stranger.miss.reason == "new" and stranger.miss.token_index == 0
    assert stranger.tiers == {"ram": 0, "ssd": 0, "redis": 0}
    engine.clear_cache()
    # Not even that the owner's prefix was evicted.
    assert engine.explain(prompt, cache_salt="stranger").miss.reason == "new"  # type: ignore[union-attr]


def test_evicted_after_a_clear_says_so(engine: Engine) -> None:
    prompt = random_prompt(102, 4 * BS + 2)
    engine.generate(prompt, GREEDY, cache_salt="t2")
    engine.clear_cache()
    exp = engine.explain(prompt, cache_salt="t2")
    assert exp.cached_tokens == 0 and exp.miss is not None
    assert (exp.miss.token_index, exp.miss.reason) == (0, "evicted")
    assert "ram" in exp.miss.detail and "cache clear" in exp.miss.detail


def test_evicted_by_capacity(tiny_llama_dir: Path) -> None:
    # Room for 8 blocks: the second long prompt pushes the first one's blocks out.
    kv_per_block = 2 * 2 * 2 * 16 * 4 * BS  # layers * k/v * kv heads * head dim * fp32
    cfg = CacheConfig(block_size=BS, ram_cache_bytes=9 * kv_per_block)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as small:
        first = random_prompt(103, 6 * BS)
        small.generate(first, GREEDY)
        small.generate(random_prompt(104, 7 * BS), GREEDY)
        exp = small.explain(first)
        assert exp.miss is not None and exp.miss.reason == "evicted"
        assert exp.miss.token_index == exp.cached_tokens
        assert "evicted to make room" in exp.miss.detail
        assert small.generate(first, GREEDY).cached_tokens == exp.cached_tokens


def test_explain_changes_no_counter_and_holds_no_block(engine: Engine) -> None:
    prompt = random_prompt(105, 3 * BS)
    engine.generate(prompt, GREEDY)
    assert engine.prefix is not None
    before = engine.prefix.pool.stats()
    for _ in range(20):
        engine.explain(prompt)
    after = engine.prefix.pool.stats()
    assert after == before  # hit/query counters, references and eviction counts alike


def test_explain_from_many_threads_while_the_engine_generates(engine: Engine) -> None:
    prompts = [random_prompt(200 + i, 4 * BS) for i in range(6)]
    errors: list[BaseException] = []

    def explain_loop() -> None:
        try:
            for _ in range(30):
                for p in prompts:
                    exp = engine.explain(p)
                    assert 0 <= exp.cached_tokens < len(p)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=explain_loop) for _ in range(3)]
    for t in threads:
        t.start()
    for p in prompts:
        engine.generate(p, GREEDY)
    for t in threads:
        t.join()
    assert not errors
    engine.prefix.pool.check()  # type: ignore[union-attr]


def test_history_is_bounded_and_forgets_the_oldest() -> None:
    history = CacheHistory(max_blocks=3)
    for i in range(5):
        history.record(b"p%d" % (i % 2), bytes([i]) * 4, "ram", "capacity")
    assert len(history) == 3
    assert [e.token_ids[0] for e in history.children(b"p0")] == [4, 2]
    assert [e.token_ids[0] for e in history.children(b"p1")] == [3]


def test_each_request_logs_its_attribution_at_debug_level(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = random_prompt(106, 3 * BS + 1)
    with caplog.at_level(logging.DEBUG, logger="pagedkv.engine.worker"):
        engine.generate(prompt, GREEDY, cache_salt="logged")
        engine.generate(prompt, GREEDY, cache_salt="logged")
    lines = [r.getMessage() for r in caplog.records if "prefix lookup" in r.getMessage()]
    assert len(lines) == 2
    assert f"0 of {len(prompt)} prompt tokens cached" in lines[0] and "miss at 0: new" in lines[0]
    assert f"{len(prompt) - 1} of {len(prompt)}" in lines[1] and "no miss" in lines[1]
