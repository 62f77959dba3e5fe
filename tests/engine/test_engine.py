"""The engine on tiny random models: exact output with the cache, token-exact reuse."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv import CacheConfig, Engine, SamplingParams

BS = 8  # small blocks so that tiny prompts span many of them


def _rand_prompt(rng: random.Random, n: int, vocab: int = 200) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def _check_released(engine: Engine) -> None:
    if engine.prefix is not None:
        engine._call(engine.prefix.pool.check)
        assert engine.cache_stats().cache.pool.allocated == 0, "a request leaked block references"


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, tiny_llama_dir: Path, tiny_qwen2_dir: Path) -> Path:
    return tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.fixture
def engines(model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    """(cached, uncached) engines over the same model."""
    on = Engine.from_pretrained(
        str(model_dir), config=CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20)
    )
    off = Engine.from_pretrained(str(model_dir), config=CacheConfig(enable_prefix_caching=False))
    yield on, off
    _check_released(on)
    on.close()
    off.close()


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_shared_prefix_prompts_give_identical_greedy_output(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    rng = random.Random(1)
    shared = _rand_prompt(rng, 45)
    for i in range(5):
        prompt = shared + _rand_prompt(rng, 3 + 7 * i)
        got, want = on.generate(prompt, GREEDY), off.generate(prompt, GREEDY)
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        if i > 0:
            assert got.cached_tokens >= len(shared)


def test_seeded_sampling_identical_with_cache(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    rng = random.Random(2)
    prompt = _rand_prompt(rng, 30)
    params = SamplingParams(
        max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True
    )
    on.generate(prompt, params)
    got = on.generate(prompt, params)
    assert got.cached_tokens == len(prompt) - 1
    assert got.token_ids == off.generate(prompt, params).token_ids


def test_multi_turn_reuses_every_computed_token(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    rng = random.Random(3)
    prompt = _rand_prompt(rng, 21)
    for _turn in range(4):
        got, want = on.generate(prompt, GREEDY), off.generate(prompt, GREEDY)
        assert got.token_ids == want.token_ids
        # Everything fed to the model before (prompt + answer but its last token) is reused.
        computed = len(prompt) + len(got.token_ids) - 1
        prompt = prompt + got.token_ids + _rand_prompt(rng, 5)
        nxt = on.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        assert nxt.cached_tokens == computed
        # the probe above cached its own tail; the next turn starts from it
        prompt = prompt + nxt.token_ids


def test_exact_repeat_recomputes_only_the_last_token(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    prompt = _rand_prompt(random.Random(4), 40)  # 5 full blocks exactly
    first = on.generate(prompt, GREEDY)
    again = on.generate(prompt, GREEDY)
    assert first.cached_tokens == 0
    assert again.cached_tokens == len(prompt) - 1
    assert again.token_ids == first.token_ids == off.generate(prompt, GREEDY).token_ids


def test_prompt_shorter_than_a_block(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    prompt = [5, 6, 7]
    first = on.generate(prompt, GREEDY)
    again = on.generate(prompt, GREEDY)
    assert again.cached_tokens == 2
    assert first.token_ids == again.token_ids == off.generate(prompt, GREEDY).token_ids


def test_mid_block_match(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    rng = random.Random(5)
    a = _rand_prompt(rng, 29)
    b = a[:19] + [t + 1 for t in a[19:]]  # diverges in the middle of the third block
    on.generate(a, GREEDY)
    got = on.generate(b, GREEDY)
    assert got.cached_tokens == 19
    assert got.token_ids == off.generate(b, GREEDY).token_ids


def test_small_ram_budget_forces_evictions_and_stays_exact(model_dir: Path) -> None:
    probe = Engine.from_pretrained(str(model_dir), config=CacheConfig(block_size=BS))
    assert probe.prefix is not None
    bpb = probe.prefix.ram.layout.bytes_per_block
    probe.close()
    on = Engine.from_pretrained(
        str(model_dir), config=CacheConfig(block_size=BS, ram_cache_bytes=12 * bpb)
    )
    off = Engine.from_pretrained(str(model_dir), config=CacheConfig(enable_prefix_caching=False))
    rng = random.Random(6)
    prompts = [_rand_prompt(rng, rng.randrange(10, 60)) for _ in range(6)]
    for prompt in prompts * 2:
        assert on.generate(prompt, GREEDY).token_ids == off.generate(prompt, GREEDY).token_ids
    stats = on.cache_stats().cache.pool
    assert stats.evictions > 0
    assert stats.num_blocks <= 13
    _check_released(on)
    on.close()
    off.close()


def test_four_threads_at_once(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    rng = random.Random(7)
    shared = _rand_prompt(rng, 24)
    prompts = [shared + _rand_prompt(rng, 4 + i) for i in range(8)]
    want = [off.generate(p, GREEDY).token_ids for p in prompts]
    got: dict[int, list[int]] = {}

    def worker(k: int) -> None:
        for i in range(k, len(prompts), 4):
            got[i] = on.generate(prompts[i], GREEDY).token_ids

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(prompts))] == want


def test_cancelled_stream_releases_blocks(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    prompt = _rand_prompt(random.Random(8), 50)
    stream = on.stream(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()
    done = on.generate([1, 2, 3], GREEDY)  # runs after the worker noticed the cancel
    assert done.finish_reason == "length"
    _check_released(on)


def test_stream_text_equals_generate_text(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    prompt = _rand_prompt(random.Random(9), 20)
    events = list(on.stream(prompt, GREEDY))
    final = events[-1].result
    assert final is not None and events[-1].finished
    assert "".join(e.text for e in events) == final.text == on.generate(prompt, GREEDY).text
    assert [t for e in events for t in e.token_ids] == final.token_ids


def test_stop_strings_and_max_tokens(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    prompt = _rand_prompt(random.Random(10), 20)
    full = on.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    if stop.strip():
        cut = on.generate(prompt, SamplingParams(max_tokens=16, stop=[stop], ignore_eos=True))
        assert cut.finish_reason == "stop"
        assert stop not in cut.text and full.text.startswith(cut.text)
    first = full.token_ids[3]
    by_id = on.generate(
        prompt, SamplingParams(max_tokens=16, stop_token_ids=[first], ignore_eos=True)
    )
    assert by_id.finish_reason == "stop" and by_id.token_ids[-1] == first


def test_cache_salt_isolates(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    prompt = _rand_prompt(random.Random(11), 30)
    on.generate(prompt, GREEDY, cache_salt="tenant-a")
    assert on.generate(prompt, GREEDY, cache_salt="tenant-b").cached_tokens == 0
    assert on.generate(prompt, GREEDY, cache_salt="tenant-a").cached_tokens == len(prompt) - 1


def test_chat_uses_the_template(engines: tuple[Engine, Engine]) -> None:
    on, off = engines
    msgs = [{"role": "user", "content": "hello there"}]
    a = on.chat(msgs, GREEDY)
    b = on.chat(msgs, GREEDY)
    assert a.prompt_tokens == len(on.apply_chat_template(msgs))
    assert b.cached_tokens == a.prompt_tokens - 1
    assert a.text == b.text == off.chat(msgs, GREEDY).text


def test_unsupported_layers_run_without_cache_and_say_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Falcon-H1 keeps attention KV and a Mamba-2 state in one cache layer, which
    pagedkv cannot restore: caching is off, with a warning naming the layer type,
    and the statistics (what /v1/cache/stats shows) say why."""
    from fixtures_models import make_tiny_model

    from pagedkv.server.metrics import stats_json

    model = make_tiny_model(tmp_path / "falcon-h1", arch="falcon_h1", seed=4)
    with caplog.at_level("WARNING"):
        eng = Engine.from_pretrained(str(model), config=CacheConfig(block_size=BS))
    off = Engine.from_pretrained(str(model), config=CacheConfig(enable_prefix_caching=False))
    assert eng.prefix is None
    warnings = [r.getMessage() for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert warnings and "LinearAttentionAndFullAttentionLayer" in warnings[0]
    stats = stats_json(eng.cache_stats())
    assert stats["prefix_caching"] is False
    assert "LinearAttentionAndFullAttentionLayer" in str(stats["caching_off_reason"])
    prompt = _rand_prompt(random.Random(12), 30)
    a = eng.generate(prompt, GREEDY)
    assert eng.generate(prompt, GREEDY).cached_tokens == 0
    assert a.token_ids == off.generate(prompt, GREEDY).token_ids
    eng.close()
    off.close()


def test_bad_input_is_refused_clearly(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    with pytest.raises(ValueError, match="empty"):
        on.generate([], GREEDY)
    with pytest.raises(ValueError, match="context"):
        on.generate([5] * (on.max_context + 1), GREEDY)
    with pytest.raises(TypeError):
        on.generate([1, "x"], GREEDY)  # type: ignore[list-item]
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_close_with_requests_in_flight_ends_every_caller(model_dir: Path) -> None:
    eng = Engine.from_pretrained(str(model_dir), config=CacheConfig(block_size=BS))
    results: list[object] = []

    def call(i: int) -> None:
        try:
            results.append(
                eng.generate(
                    _rand_prompt(random.Random(i), 30),
                    SamplingParams(max_tokens=400, ignore_eos=True),
                )
            )
        except Exception as exc:  # a queued request may be refused at shutdown
            results.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    eng.close(timeout=20)
    for t in threads:
        t.join(30)
    assert len(results) == 6, "a caller was left waiting after close()"
    assert eng.cache_stats().cache.pool.allocated == 0
    with pytest.raises(Exception, match="closed"):
        eng.generate([1, 2, 3], GREEDY)
