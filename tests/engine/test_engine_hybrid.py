"""Sliding-window and recurrent-hybrid models with prefix caching on, on every tier.

Five tiny random models, one per layer mix: Mistral (sliding on every layer),
Gemma 3 (three sliding layers, then a global one), gpt-oss (sliding / global with
attention sinks, run one sequence per forward), LFM2 (short convolutions +
attention) and Qwen3-Next (gated delta rule + attention). Every answer must equal
the cache-off greedy answer, and every turn must reuse what the turns before it
computed: all of it for attention models, up to the last snapshot boundary for
recurrent ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_helpers import GREEDY, random_prompt, run_worker
from fixtures_models import make_tiny_model

from pagedkv import CacheConfig, Engine

BS = 4  # windows of 16 tokens are 4 blocks
ARCHS = ["mistral", "gemma3_text", "gpt_oss", "lfm2", "qwen3_next"]
RECURRENT = {"lfm2", "qwen3_next"}
_OVERRIDES: dict[str, dict[str, object]] = {"mistral": {"sliding_window": 16}}


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    path = tmp_path_factory.mktemp(f"tiny-{arch}") / arch
    return make_tiny_model(path, arch=arch, seed=7, **_OVERRIDES.get(arch, {}))


def _arch(model: Path) -> str:
    return model.name


def _reusable(model: Path, computed: int) -> int:
    """What a turn can reuse of the `computed` tokens the turns before it computed."""
    return computed - computed % BS if _arch(model) in RECURRENT else computed


def _conversation(model: Path, turns: int = 4) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of a conversation (each turn: the last prompt, its answer, 11 new
    tokens) and the cache-off greedy answers; 13 + 3 * 19 = 70 tokens, 4+ windows."""
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    with Engine.from_pretrained(str(model), config=CacheConfig(enable_prefix_caching=False)) as off:
        history: list[int] = []
        for turn in range(turns):
            prompt = history + random_prompt(100 + turn, 13 if turn == 0 else 11)
            answer = off.generate(prompt, GREEDY).token_ids
            prompts.append(prompt)
            answers.append(answer)
            history = prompt + answer
    return prompts, answers


@pytest.fixture(scope="module")
def conversation(model: Path) -> tuple[list[list[int]], list[list[int]]]:
    return _conversation(model)


def test_multi_turn_and_branches_reuse_exactly(
    model: Path, conversation: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, answers = conversation
    with Engine.from_pretrained(str(model), config=CacheConfig(block_size=BS)) as eng:
        assert eng.prefix is not None, eng.cache_stats().caching_off_reason
        computed = 0
        for prompt, answer in zip(prompts, answers, strict=True):
            r = eng.generate(prompt, GREEDY)
            assert r.token_ids == answer
            assert r.cached_tokens == _reusable(model, computed)
            computed = len(prompt) + len(answer) - 1  # the last token was never run
        # Two branches off the third turn's prompt: each reuses the shared part.
        shared = prompts[2]
        branches = [shared + random_prompt(200 + i, 5) for i in range(2)]
        with Engine.from_pretrained(
            str(model), config=CacheConfig(enable_prefix_caching=False)
        ) as off:
            want = [off.generate(b, GREEDY).token_ids for b in branches]
        got = [eng.generate(b, GREEDY) for b in branches]
        assert [g.token_ids for g in got] == want
        assert got[0].cached_tokens == _reusable(model, len(shared))
        # the second branch also finds the first one's tokens up to where they part
        assert got[1].cached_tokens == _reusable(model, len(shared))


def test_restart_reuses_the_ssd_tier_exactly(
    model: Path, conversation: tuple[list[list[int]], list[list[int]]], tmp_path: Path
) -> None:
    prompts, answers = conversation
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=tmp_path / "kv", ssd_cache_bytes=2**26)
    with Engine.from_pretrained(str(model), config=cfg) as eng:
        assert eng.generate(prompts[2], GREEDY).token_ids == answers[2]
    with Engine.from_pretrained(str(model), config=cfg) as eng:
        r = eng.generate(prompts[3], GREEDY)
    assert r.token_ids == answers[3]
    assert r.cached_tokens == _reusable(model, len(prompts[2]) + len(answers[2]) - 1)
    assert r.tier_hits.get("ssd", 0) == r.cached_tokens


def test_second_process_reuses_redis_exactly(
    model: Path, conversation: tuple[list[list[int]], list[list[int]]], redis_url: str
) -> None:
    prompts, answers = conversation
    cfg = CacheConfig(block_size=BS, redis_url=redis_url)
    with Engine.from_pretrained(str(model), config=cfg) as eng:
        eng.generate(prompts[2], GREEDY)
    (result, stats) = run_worker(model, {"block_size": BS, "redis_url": redis_url}, [prompts[3]])
    assert result["token_ids"] == answers[3]
    assert result["cached_tokens"] == _reusable(model, len(prompts[2]) + len(answers[2]) - 1)
    assert result["tier_hits"].get("redis", 0) == result["cached_tokens"]
    assert stats["stats"]["cache"]["tiers"]["redis"]["hits"] > 0
