"""Spare KV buffers: a finished sequence's buffer serves the next one of about its size,
whatever it still holds, and gives way to any sequence that needs the budget."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from fake_backend import FakeBackend, FakeSeqKV

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine.scheduler import GROW_TOKENS

BS = 8
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def _engine(model: Path, **config: object) -> Engine:
    return Engine.from_pretrained(
        str(model), config=CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20, **config)
    )


@pytest.mark.parametrize("which", ["llama", "sliding"])
def test_a_reused_buffer_changes_no_answer(
    which: str, tiny_llama_dir: Path, tiny_sliding_dir: Path
) -> None:
    """A cached prefix restored into a spare that still holds another prompt's KV (for
    the sliding model, rows below the window are left as they are) answers as a fresh
    engine with nothing cached does."""
    directory = tiny_llama_dir if which == "llama" else tiny_sliding_dir
    shared = _prompt(1, 48)
    asked = shared + _prompt(2, 9)
    with _engine(directory) as fresh:
        want = fresh.generate(asked, GREEDY).token_ids
    with _engine(directory) as eng:
        worker = eng._worker
        eng.generate(shared + _prompt(3, 9), GREEDY)  # caches `shared`
        assert len(worker.spares) == 1
        buffer = worker.spares[0].restore_target().data_ptr()
        eng.generate(_prompt(4, 57), GREEDY)  # other KV into the same buffer
        assert [s.restore_target().data_ptr() for s in worker.spares] == [buffer]
        got = eng.generate(asked, GREEDY)
        assert got.cached_tokens >= 48 - BS
        assert got.token_ids == want
        assert [s.restore_target().data_ptr() for s in worker.spares] == [buffer]
        assert worker.scheduler.spare_tokens == worker.spares[0].capacity
        stats = eng.cache_stats().scheduling
        assert stats is not None and stats.kv_reserved_bytes == 0


def test_spares_give_way_to_a_sequence_that_needs_the_budget(tiny_llama_dir: Path) -> None:
    probe = _engine(tiny_llama_dir)
    per_token = probe.adapter.kv_bytes_per_token
    big = _prompt(5, 560)
    want = probe.generate(big, GREEDY).token_ids
    probe.close()
    with _engine(tiny_llama_dir, kv_budget_bytes=600 * per_token) as eng:
        eng.generate(_prompt(6, 40), GREEDY)
        sched = eng._worker.scheduler
        assert sched.spare_tokens > 0
        # 572 tokens fit the budget alone but not next to the spare: it must go.
        assert not sched.fits(len(big) + GREEDY.max_tokens)
        assert eng.generate(big, GREEDY).token_ids == want
        assert sched.reserved_tokens + sched.spare_tokens <= sched.budget_tokens


def test_a_forked_sample_takes_a_spare(tiny_llama_dir: Path) -> None:
    """A request's second sample copies the prompt's KV into a spare, not into a new
    buffer (whose pages would cost their first touch), and answers as in a fresh engine."""
    params = SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=5)
    asked = _prompt(6, 40)
    with _engine(tiny_llama_dir) as fresh:
        want = [r.token_ids for r in fresh.generate_n(asked, params)]
    with _engine(tiny_llama_dir) as eng:
        worker = eng._worker
        eng.generate_n(_prompt(7, 40), params)  # two samples end: two spares
        assert len(worker.spares) == 2
        buffers = {s.restore_target().data_ptr() for s in worker.spares}
        got = [r.token_ids for r in eng.generate_n(asked, params)]
        assert got == want
        assert {s.restore_target().data_ptr() for s in worker.spares} == buffers


@pytest.mark.parametrize("reuses_kv", [True, False])
def test_spares_only_where_the_backend_reuses_kv(
    reuses_kv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests that each grow past their first reservation and fork a second
    sample. Where the backend's KV is not worth reusing (`reuses_kv` False, as on MLX)
    no spare is ever kept and every growth and fork is the backend's own `grown` and
    `copy`; where it is, the second request starts, forks and grows in the first one's
    spares instead (the control: the same counts can tell the two apart)."""
    calls = {"grown": 0, "copy": 0}
    copy = FakeSeqKV.copy

    def count_grown(kv: FakeSeqKV, capacity: int, num_tokens: int) -> FakeSeqKV:
        calls["grown"] += 1
        return copy(kv, num_tokens, capacity)  # the fake's `grown`, not counted as a fork

    def count_copy(kv: FakeSeqKV, num_tokens: int, capacity: int) -> FakeSeqKV:
        calls["copy"] += 1
        return copy(kv, num_tokens, capacity)

    monkeypatch.setattr(FakeSeqKV, "grown", count_grown)
    monkeypatch.setattr(FakeSeqKV, "copy", count_copy)
    backend = FakeBackend(reuses_kv=reuses_kv)
    params = SamplingParams(max_tokens=GROW_TOKENS + 4, n=2, temperature=1.0, seed=5)
    config = CacheConfig(block_size=BS, ram_cache_bytes=2**20)
    with Engine(backend, config) as eng:  # type: ignore[arg-type]
        worker = eng._worker
        rounds = []
        for seed in (8, 9):
            calls.update(grown=0, copy=0)
            eng.generate_n([3 + i % 40 for i in _prompt(seed, 20)], params)
            rounds.append((dict(calls), len(worker.spares), worker.scheduler.spare_tokens))
    (first, kept, _), (second, _, _) = rounds
    assert first == {"grown": 2, "copy": 1}, first  # no spare yet either way
    if reuses_kv:
        assert kept == 2 and second == {"grown": 0, "copy": 0}, rounds
    else:
        assert all(spares == tokens == 0 for _, spares, tokens in rounds), rounds
        assert second == first, rounds
