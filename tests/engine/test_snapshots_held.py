"""Recurrent-state snapshots of a running sequence: it holds at most one, the KV
budget's reservation covers it, and a long prompt's snapshots still reach the cache
(a repeat resumes from the last one, with the cache-off answer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_helpers import GREEDY, random_prompt
from fixtures_models import make_tiny_model

from pagedkv import CacheConfig, Engine, SamplingParams

BS = 4
PROMPT = 150  # 37 snapshot boundaries with a snapshot every block


@pytest.fixture(scope="module", params=["lfm2", "qwen3_next"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(f"tiny-{request.param}") / request.param
    return make_tiny_model(path, arch=request.param, seed=7)


def _watch(eng: Engine) -> list[tuple[int, int, int]]:
    """After every forward, on the worker thread: (most snapshots one running sequence
    holds, reserved budget tokens, what the running sequences' KV capacity and one
    snapshot each come to in tokens)."""
    worker, sched = eng._worker, eng._worker.scheduler
    store = eng.prefix.snapshots if eng.prefix is not None else None
    assert store is not None
    per_token = eng.adapter.kv_bytes_per_token
    seen: list[tuple[int, int, int]] = []
    real = worker._forward

    def forward(work: Any) -> Any:
        out = real(work)
        held = max((len(s.snapshots) for s in sched.running), default=0)
        need = sum(s.capacity + -(-store.nbytes // per_token) for s in sched.running)
        seen.append((held, sched.reserved_tokens, need))
        return out

    worker._forward = forward  # type: ignore[method-assign]
    return seen


def test_a_long_prompt_holds_one_snapshot_inside_its_reservation(model: Path) -> None:
    prompt = random_prompt(5, PROMPT)
    params = SamplingParams(max_tokens=3 * BS + 1, ignore_eos=True)
    with Engine.from_pretrained(str(model), config=CacheConfig(enable_prefix_caching=False)) as off:
        want = off.generate(prompt, params).token_ids
    config = CacheConfig(block_size=BS, snapshot_interval_blocks=1)
    with Engine.from_pretrained(str(model), config=config) as eng:
        seen = _watch(eng)
        first = eng.generate(prompt, params)
        assert len(seen) > PROMPT // BS  # a forward per snapshot interval
        assert all(reserved >= need for _, reserved, need in seen), seen
        assert max(held for held, _, _ in seen) <= 1
        assert first.token_ids == want
        again = eng.generate(prompt, params)
        assert again.token_ids == want  # cached == fresh
        assert again.cached_tokens == (PROMPT - 1) // BS * BS  # the prompt's last snapshot
        books = eng.accounting()
        assert books.balanced and books.kv_reserved_bytes == 0
        # A conversation's next turn resumes from the answer's last snapshot.
        turn = prompt + again.token_ids + random_prompt(6, 5)
        computed = len(prompt) + len(again.token_ids) - 1
        assert eng.generate(turn, GREEDY).cached_tokens == computed // BS * BS


def test_too_large_counts_the_snapshots(model: Path) -> None:
    probe = Engine.from_pretrained(str(model), config=CacheConfig(block_size=BS))
    per_token = probe.adapter.kv_bytes_per_token
    assert probe.prefix is not None and probe.prefix.snapshots is not None
    snapshot = probe.prefix.snapshots.nbytes
    probe.close()
    kv_only = (10 + 6) * 2 * per_token  # n=2 samples of 10 prompt + 6 answer tokens
    config = CacheConfig(block_size=BS, kv_budget_bytes=kv_only + snapshot)
    with Engine.from_pretrained(str(model), config=config) as eng:
        params = SamplingParams(max_tokens=6, n=2, temperature=1.0, ignore_eos=True)
        with pytest.raises(ValueError, match="KV budget"):
            eng.generate_n(random_prompt(7, 10), params)
        one = eng.generate(random_prompt(7, 10), SamplingParams(max_tokens=6, ignore_eos=True))
        assert one.completion_tokens == 6  # one sample and its snapshot fit
