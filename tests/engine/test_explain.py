"""Explaining a lookup on a real engine (tiny model): new, diverged at the right token,
evicted by capacity and by a clear, another tenant; that explaining changes nothing;
and that no answer or log line carries a token of another request, whether that
request's blocks are in RAM, on SSD after a restart or only in the eviction history."""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from engine_helpers import BS, GREEDY, random_prompt

from pagedkv import CacheConfig, Engine, SamplingParams
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
    # This prompt's own next tokens as text; nothing of the earlier one's.
    assert f"continues {engine.decode(other[at : at + 8])!r}" in exp.miss.detail
    assert engine.decode(prompt[at : at + 8]) not in exp.miss.detail
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


def test_history_is_bounded_forgets_the_oldest_and_answers_lengths_only() -> None:
    history = CacheHistory(max_blocks=3)
    for i in range(5):  # block i: tokens [i, i + 1]; parent p0 or p1
        history.record(b"p%d" % (i % 2), np.array([i, i + 1], "<i4").tobytes(), "ram", "clear")
    assert len(history) == 3
    assert history.agreement(b"p0", np.array([0, 1], np.int32)).num_tokens == 0  # type: ignore[union-attr]
    for i, parent in [(2, b"p0"), (4, b"p0"), (3, b"p1")]:
        found = history.agreement(parent, np.array([i, i + 1, 9], np.int32))
        assert found is not None and found.num_tokens == 2 and found.departure.reason == "clear"
        one = history.agreement(parent, np.array([i, 99], np.int32))
        assert one is not None and one.num_tokens == 1
    assert history.agreement(b"p2", np.array([1], np.int32)) is None
    # What it answers is a count and a departure: no field can hold a token.
    assert set(type(found).__slots__) == {"num_tokens", "departure"}


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


# Two prompts of one tenant (say, two end users of one application key) that share a
# prefix of digits: A then goes on in words, B in digits. Each of these token ids
# decodes to a piece of text ('hello', 'Blocks', 'Lar', 'Onc', 'zen') that no digit
# prompt and no sentence of explain's own contains, so finding one in B's answer means
# the answer carried A's tokens.
A_WORDS = [377, 424, 426, 428, 487]
DIGITS = list(range(18, 28))  # '0' .. '9'


def _digits(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(DIGITS) for _ in range(n)]


def _a_and_b(seed: int) -> tuple[list[int], list[int], int]:
    """A and B, and the index of their first differing token (inside a block)."""
    shared = _digits(seed, 3 * BS + 3)
    a = shared + [A_WORDS[i % len(A_WORDS)] for i in range(2 * BS)]
    b = shared + _digits(seed + 1, 2 * BS)
    return a, b, len(shared)


def assert_nothing_of_a(decode: object, answer: object) -> None:
    """No text of A's words and no list of token ids anywhere in `answer` (JSON)."""
    text = json.dumps(answer, ensure_ascii=False)
    for t in A_WORDS:
        piece = decode([t])  # type: ignore[operator]
        assert piece not in text, f"A's token {t} ({piece!r}) is in B's answer: {text}"

    def walk(v: object) -> None:
        if isinstance(v, list):
            assert not any(isinstance(x, int) for x in v), f"token ids in the answer: {text}"
        for child in v.values() if isinstance(v, dict) else v if isinstance(v, list) else ():
            walk(child)

    walk(answer)


def test_no_token_of_another_request_from_ram(engine: Engine) -> None:
    a, b, at = _a_and_b(300)
    engine.generate(a, GREEDY, cache_salt="shared-app")
    exp = engine.explain(b, cache_salt="shared-app")
    assert exp.miss is not None and (exp.miss.token_index, exp.miss.reason) == (at, "diverged")
    assert exp.cached_tokens == at
    assert_nothing_of_a(engine.decode, exp.to_json())
    # Asking again with B extended by one guessed token tells no more than a request would.
    assert engine.decode(b[at : at + 8]) in exp.miss.detail  # B's own text may be quoted


def test_no_token_of_another_request_from_ssd_after_a_restart(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=tmp_path / "kv", ssd_cache_bytes=64 * 2**20)
    a, b, at = _a_and_b(301)
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as first:
        first.generate(a, GREEDY, cache_salt="shared-app")
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as second:
        exp = second.explain(b, cache_salt="shared-app")
        assert exp.miss is not None and exp.miss.reason == "diverged"
        assert exp.miss.token_index == exp.cached_tokens == at
        assert exp.tiers["ssd"] == at
        assert_nothing_of_a(second.decode, exp.to_json())


def test_no_token_of_another_request_from_the_eviction_history(engine: Engine) -> None:
    # A's blocks leave RAM (a clear), then its prefix alone is cached again by a
    # request that generates nothing further: the only child B's miss can find is
    # A's evicted block, in the history.
    a, b, _ = _a_and_b(302)
    prefix = a[: 3 * BS]
    b = prefix + b[3 * BS :]
    b[3 * BS] = 27 if a[3 * BS] != 27 else 26  # B differs at the block's first token
    engine.generate(a, GREEDY, cache_salt="history-app")
    engine.clear_cache()
    engine.generate(prefix, SamplingParams(max_tokens=1), cache_salt="history-app")
    exp = engine.explain(b, cache_salt="history-app")
    assert exp.miss is not None and (exp.miss.token_index, exp.miss.reason) == (3 * BS, "diverged")
    assert_nothing_of_a(engine.decode, exp.to_json())
    # And with the prefix gone too, A's evicted blocks are reported by position only.
    engine.clear_cache()
    gone = engine.explain(a[: 3 * BS + 5] + _digits(9, BS), cache_salt="history-app")
    assert gone.miss is not None and gone.miss.reason == "evicted"
    assert_nothing_of_a(engine.decode, gone.to_json())


def test_the_debug_log_carries_no_token_of_another_request(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    a, b, at = _a_and_b(303)
    with caplog.at_level(logging.DEBUG, logger="pagedkv.engine.worker"):
        engine.generate(a, GREEDY, cache_salt="logged-app")
        engine.generate(b, GREEDY, cache_salt="logged-app")
    lines = [r.getMessage() for r in caplog.records if "prefix lookup" in r.getMessage()]
    assert len(lines) == 2 and f"miss at {at}: diverged" in lines[1]
    assert_nothing_of_a(engine.decode, lines[1])
