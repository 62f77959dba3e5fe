"""Requests with n > 1 whose extra samples fail to start, or whose seed is near 2**64:
nothing they reserved stays reserved, and the engine keeps admitting requests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import random_prompt

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine import worker as worker_module
from pagedkv.engine.sampling import Sampler

MAX_QUEUE = 2
SAMPLED = SamplingParams(max_tokens=4, temperature=1.0, n=3, ignore_eos=True)


@pytest.fixture
def eng(tiny_llama_dir: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(
        str(tiny_llama_dir), config=CacheConfig(block_size=8), max_queue=MAX_QUEUE
    ) as engine:
        yield engine


def _assert_nothing_held(eng: Engine) -> None:
    books = eng.accounting()
    assert books.pending_requests == 0, books
    assert books.running == books.waiting == 0, books
    assert books.kv_reserved_bytes == 0, books
    assert books.balanced
    assert eng.num_active_requests() == 0
    if eng.prefix is not None:
        eng._call(eng.prefix.pool.check)
        assert eng.cache_stats().cache.pool.allocated == 0  # type: ignore[union-attr]


def test_a_seed_near_two_to_the_64_wraps_and_holds_nothing(eng: Engine) -> None:
    prompt = random_prompt(1, 20)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=2**64 - 1, n=3, ignore_eos=True)
    for _ in range(MAX_QUEUE + 1):  # past max_queue: a leaked slot would refuse the last
        results = eng.generate_n(prompt, params)
        assert [r.finish_reason for r in results] == ["length"] * 3
    # Sample i draws from (seed + i) mod 2**64: sample 1 is seed 0's first sample.
    single = SamplingParams(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    assert results[1].token_ids == eng.generate(prompt, single).token_ids
    _assert_nothing_held(eng)


def test_seeds_outside_what_a_generator_takes_are_refused() -> None:
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed must be an int"):
            SamplingParams(seed=seed)


def _fail_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building any sample's sampler but the first raises (before it is adopted)."""

    class Broken(Sampler):
        def __init__(self, params: SamplingParams, index: int = 0, **kw: Any) -> None:
            if index > 0:
                raise RuntimeError("injected: a sampler that cannot be built")
            super().__init__(params, index, **kw)

    monkeypatch.setattr(worker_module, "Sampler", Broken)


def _fail_buffer(monkeypatch: pytest.MonkeyPatch, eng: Engine) -> None:
    """A sibling's KV buffer cannot be allocated (after it is adopted)."""
    real = eng._worker._copy_kv

    def broken(kv: Any, seq: Any) -> Any:
        if seq.index > 0:
            raise MemoryError("injected: no memory for a sibling's buffer")
        return real(kv, seq)

    monkeypatch.setattr(eng._worker, "_copy_kv", broken)


def _fail_second_sibling(monkeypatch: pytest.MonkeyPatch, eng: Engine) -> None:
    """The first sibling starts, the second one's first token cannot be sampled."""
    real = eng._worker._emit_token

    def broken(seq: Any, logits: Any) -> None:
        if seq.index == 2:
            raise RuntimeError("injected: sampling a sibling failed")
        real(seq, logits)

    monkeypatch.setattr(eng._worker, "_emit_token", broken)


@pytest.mark.parametrize("where", ["sampler", "buffer", "second-sibling"])
def test_a_failure_while_forking_releases_everything(
    eng: Engine, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    if where == "sampler":
        _fail_sampler(monkeypatch)
    elif where == "buffer":
        _fail_buffer(monkeypatch, eng)
    else:
        _fail_second_sibling(monkeypatch, eng)
    prompt = random_prompt(2, 20)
    for _ in range(MAX_QUEUE + 1):
        with pytest.raises((RuntimeError, MemoryError), match="injected"):
            eng.generate_n(prompt, SAMPLED)
    _assert_nothing_held(eng)
    monkeypatch.undo()
    assert len(eng.generate_n(prompt, SAMPLED)) == 3  # the engine still admits
    _assert_nothing_held(eng)
