"""The worker, scheduler and prefix cache above the seam, on a fake backend
(`fake_backend.py`): cached == fresh, preemption, forks, growth, and every failure
path giving back the budget and the blocks. No transformers, no model: fast."""

from __future__ import annotations

import random

import pytest
from fake_backend import FakeBackend

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine.request import GenerationResult, RequestStream
from pagedkv.engine.scheduler import GROW_TOKENS

BS = 8
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40) for _ in range(n)]


def _engine(batched: bool = True, **config: object) -> tuple[Engine, FakeBackend]:
    backend = FakeBackend(batched)
    settings = {"block_size": BS, "ram_cache_bytes": 2**20, **config}
    return Engine(backend, CacheConfig(**settings)), backend  # type: ignore[arg-type]


def _fresh(prompt: list[int], params: SamplingParams, batched: bool = True) -> list[int]:
    eng, _ = _engine(batched, enable_prefix_caching=False)
    with eng:
        return eng.generate(prompt, params).token_ids


def _result(stream: RequestStream) -> GenerationResult:
    """The last event's result (one sample)."""
    results = [event.result for event in stream if event.finished]
    assert len(results) == 1 and results[0] is not None
    return results[0]


def _assert_nothing_held(eng: Engine) -> None:
    books = eng.accounting()
    assert books.balanced and books.kv_reserved_bytes == 0, books
    assert books.running == books.waiting == 0, books
    assert eng.prefix is not None
    eng._call(eng.prefix.pool.check)
    stats = eng.cache_stats().cache
    assert stats is not None and stats.pool.allocated == 0


def test_the_fake_reads_what_was_restored() -> None:
    """The fake is honest: logits after a wrong restore differ from the right ones."""
    from pagedkv.model.batch import SeqChunk

    backend, ids = FakeBackend(), _prompt(1, 12)
    kv = backend.new_kv(16)
    want = backend.forward_step([SeqChunk(kv, 0, ids, True)])[0]
    right = kv.copy(11, 16)
    assert backend.forward_step([SeqChunk(right, 11, ids[11:], True)])[0].equal(want)
    wrong = kv.copy(11, 16)
    wrong.restore_target()[:, :, :, 3] += 0.5
    assert not backend.forward_step([SeqChunk(wrong, 11, ids[11:], True)])[0].equal(want)


@pytest.mark.parametrize("batched", [True, False])
def test_cached_equals_fresh(batched: bool) -> None:
    shared = _prompt(2, 40)
    asked = shared + _prompt(3, 9)
    want = _fresh(asked, GREEDY, batched)
    eng, _ = _engine(batched)
    with eng:
        eng.generate(shared + _prompt(4, 5), GREEDY)
        got = eng.generate(asked, GREEDY)
        assert got.cached_tokens >= 40 // BS * BS
        assert got.token_ids == want
        again = eng.generate(asked, GREEDY)  # the whole prompt but its last token
        assert again.cached_tokens >= (len(asked) - 1) // BS * BS
        assert again.token_ids == want
        _assert_nothing_held(eng)


def test_a_long_answer_grows_its_kv_and_stays_exact() -> None:
    prompt = _prompt(5, 20)
    params = SamplingParams(max_tokens=GROW_TOKENS + 40, ignore_eos=True)
    want = _fresh(prompt, params)
    eng, _ = _engine()
    with eng:
        seen: list[int] = []
        real = eng._worker.scheduler.grow

        def grow(seq: object, capacity: int) -> None:
            seen.append(capacity)
            real(seq, capacity)  # type: ignore[arg-type]

        eng._worker.scheduler.grow = grow  # type: ignore[method-assign]
        assert eng.generate(prompt, params).token_ids == want
        assert seen, "the sequence never grew"
        _assert_nothing_held(eng)


def test_a_preempted_sequence_resumes_as_a_cache_hit() -> None:
    """Two sequences admitted side by side outgrow a budget that holds both at first:
    the newest is preempted, caches what it computed, and resumes by restoring it."""
    params = SamplingParams(max_tokens=GROW_TOKENS + 30, ignore_eos=True)
    prompts = [_prompt(6, 40), _prompt(7, 40)]
    wants = [_fresh(p, params) for p in prompts]
    start = 40 + GROW_TOKENS
    per_token = FakeBackend().kv_bytes_per_token
    eng, backend = _engine(kv_budget_bytes=(2 * start + 10) * per_token)
    chunks: list[tuple[int, int]] = []
    real = backend.forward_step

    def forward_step(chunk_list, *args, **kwargs):  # type: ignore[no-untyped-def]
        chunks.extend((c.start, len(c.token_ids)) for c in chunk_list)
        return real(chunk_list, *args, **kwargs)

    backend.forward_step = forward_step  # type: ignore[method-assign]
    with eng:
        streams = [eng.stream(p, params) for p in prompts]
        results = [_result(s) for s in streams]
        assert [r.token_ids for r in results] == wants
        preemptions = eng._worker.preemptions
        assert preemptions >= 1
        # Restored, not recomputed: each resume computes less than a block again.
        once = sum(len(p) + params.max_tokens - 1 for p in prompts)
        assert once <= sum(n for _, n in chunks) < once + BS * preemptions
        _assert_nothing_held(eng)


def test_forked_samples_each_equal_a_fresh_one() -> None:
    prompt = _prompt(8, 30)
    want = _fresh(prompt, GREEDY)
    eng, _ = _engine()
    with eng:
        params = SamplingParams(max_tokens=GREEDY.max_tokens, ignore_eos=True, n=3)
        results = eng.generate_n(prompt, params)
        assert [r.token_ids for r in results] == [want] * 3
        _assert_nothing_held(eng)


@pytest.mark.parametrize("batched", [True, False])
def test_a_failed_forward_gives_everything_back(batched: bool) -> None:
    shared = _prompt(9, 24)
    eng, backend = _engine(batched)
    with eng:
        eng.generate([*shared, 5], GREEDY)  # cached: the next restores blocks, then fails
        backend.fail_on_token = 2
        with pytest.raises(RuntimeError, match="injected"):
            eng.generate([*shared, 2, 7, 8], GREEDY)
        _assert_nothing_held(eng)
        backend.fail_on_token = None
        assert eng.generate([*shared, 2, 7, 8], GREEDY).cached_tokens == 24


def test_a_cancelled_request_gives_everything_back() -> None:
    eng, _ = _engine()
    with eng:
        stream = eng.stream(_prompt(10, 30), SamplingParams(max_tokens=500, ignore_eos=True))
        next(stream)
        stream.cancel()
        assert _result(stream).finish_reason == "cancelled"
        _assert_nothing_held(eng)


def test_one_chunk_per_call_when_unbatched() -> None:
    """Two requests at once on an unbatched backend: never two chunks in one call."""
    eng, backend = _engine(False)
    with eng:
        streams = [eng.stream(_prompt(s, 20), GREEDY) for s in (12, 13)]
        assert all(len(_result(s).token_ids) == GREEDY.max_tokens for s in streams)
    assert backend.forward_calls > 2 * GREEDY.max_tokens
