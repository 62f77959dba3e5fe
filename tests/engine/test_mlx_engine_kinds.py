"""The engine on the MLX backend with a sliding-window model (Gemma 3 text: three layers
with a 16-token window, one global) and a hybrid (LFM2: short convolutions beside one
attention layer), prompts longer than the window: cached == fresh greedy output over
multi-turn chats, from SSD after a restart, from Redis in a second process, in a mixed
batch against each request alone, with kv_dtype bfloat16 and float16; Qwen3-Next (gated
delta rule) from SSD after a restart; LFM2 under preemption. Falcon-H1 stays
uncached, its reason measured (mlx-lm's Mamba-2 scan rounds otherwise in chunks).

"Fresh" is the same backend with prefix caching off (`model.mlx.layers`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'pagedkv[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'pagedkv[mlx]'")

from engine_helpers import BS, GREEDY, random_prompt, run_worker
from fixtures_models import make_tiny_model

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine import SchedulerConfig

WINDOW = 16  # the fixture's Gemma 3 window: every prompt here is longer
# mlx-lm ties LFM2's head to its embeddings and needs `block_dim`
# (tests/model/test_mlx_agreement.py)
ARCHS = {"gemma3_text": {}, "lfm2": {"tie_word_embeddings": True, "block_dim": 64}}


@pytest.fixture(scope="module", params=list(ARCHS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    path = tmp_path_factory.mktemp(f"mlx-{arch}") / "model"
    return make_tiny_model(path, arch=arch, seed=3, **ARCHS[arch])


def _mlx(model: Path, scheduling: SchedulerConfig | None = None, **cache: Any) -> Engine:
    config = CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20, backend="mlx", **cache)
    return Engine.from_pretrained(str(model), config=config, scheduling=scheduling)


def _fresh(model: Path, prompts: list[list[int]], **cache: Any) -> list[list[int]]:
    with _mlx(model, enable_prefix_caching=False, **cache) as off:
        return [off.generate(p, GREEDY).token_ids for p in prompts]


def _whole_hit(eng: Engine, prompt: list[int]) -> int:
    """Tokens a repeated prompt restores: all but its last, or, where a recurrent state
    must be restored too, up to the last block boundary (where a snapshot was taken)."""
    n = len(prompt) - 1
    return n if eng.adapter.state_layout is None else n // BS * BS


def test_the_layers_are_cached_and_n_samples_fork(model_dir: Path) -> None:
    with _mlx(model_dir) as eng:
        stats, adapter = eng.cache_stats(), eng.adapter
        assert stats.prefix_caching, stats.caching_off_reason
        if "gemma" in model_dir.parent.name:
            assert adapter.kv_windows == (WINDOW, WINDOW, WINDOW, None) and adapter.batched
        else:
            assert adapter.state_layout is not None and adapter.state_layout.numel > 0
            assert not adapter.batched
        prompt = random_prompt(80, 30)  # n > 1 forks the prompt's caches
        many = SamplingParams(max_tokens=8, temperature=0.9, seed=5, n=3, ignore_eos=True)
        forks = eng.generate_n(prompt, many)
        singles = [
            eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=5 + i,
                                                ignore_eos=True))
            for i in range(3)
        ]  # fmt: skip
        assert [r.token_ids for r in forks] == [r.token_ids for r in singles]
        assert singles[0].cached_tokens > 0


def test_multi_turn_chat_is_cached_and_equals_fresh(model_dir: Path) -> None:
    turns = ["What does a cache keep?", "And after a restart?", "Say it as a haiku."]
    with _mlx(model_dir) as eng, _mlx(model_dir, enable_prefix_caching=False) as off:
        messages: list[dict[str, str]] = []
        previous: list[int] = []
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            ids = eng.adapter.apply_chat_template(messages)
            got = eng.generate(ids, GREEDY)
            assert got.token_ids == off.generate(ids, GREEDY).token_ids, i
            if previous:
                assert ids[: len(previous)] == previous
                assert len(previous) > WINDOW and got.cached_tokens >= len(previous) // BS * BS, i
            previous = ids
            messages.append({"role": "assistant", "content": eng.adapter.decode(got.token_ids)})


def test_ssd_after_a_restart(model_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "kv"
    prompts = [random_prompt(1, 43), random_prompt(1, 43)[:30] + random_prompt(2, 11)]
    want = _fresh(model_dir, prompts)
    with _mlx(model_dir, ssd_cache_dir=ssd) as eng:
        assert eng.generate(prompts[0], GREEDY).token_ids == want[0]
    with _mlx(model_dir, ssd_cache_dir=ssd) as eng:
        first, second = (eng.generate(p, GREEDY) for p in prompts)
    assert [first.token_ids, second.token_ids] == want
    assert first.cached_tokens == _whole_hit(eng, prompts[0]) and first.tier_hits.get("ssd", 0) > 0
    assert second.cached_tokens >= 24  # its last full block of the shared 30 (a snapshot's)


def test_redis_from_a_second_process(model_dir: Path, redis_url: str) -> None:
    shared = random_prompt(11, 40)
    prompts = [shared + random_prompt(12, 6), shared + random_prompt(13, 9)]
    want = _fresh(model_dir, prompts)
    with _mlx(model_dir, redis_url=redis_url) as first:
        assert first.generate(prompts[0], GREEDY).token_ids == want[0]
        whole = _whole_hit(first, prompts[0])
    cache = {"block_size": BS, "redis_url": redis_url, "backend": "mlx"}
    *results, _ = run_worker(model_dir, cache, prompts)  # empty RAM, no SSD
    assert [r["token_ids"] for r in results] == want
    assert results[0]["cached_tokens"] == whole
    assert results[0]["tier_hits"].get("redis", 0) > 0
    assert results[1]["cached_tokens"] >= len(shared) // BS * BS


def test_mixed_batch_equals_each_request_alone(model_dir: Path) -> None:
    shared = random_prompt(10, 60)
    prompts = [shared[:k] + random_prompt(20 + k, 5) for k in (8, 17, 33, 60)]
    prompts += [random_prompt(30 + i, 9 + 4 * i) for i in range(3)]
    prompts.append(random_prompt(40, 100))  # in chunks
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    scheduling = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=36)
    with _mlx(model_dir, scheduling) as eng:
        alone = [eng.generate(p, params).token_ids for p in prompts]
        eng.clear_cache()
        eng.generate(shared, SamplingParams(max_tokens=1))
        streams = [eng.stream(p, params) for p in prompts]
        together = [[t for e in s for t in e.token_ids] for s in streams]
        assert eng.cache_stats().requests.cached_tokens > 0
    assert together == alone


def test_preemption_resumes_a_hybrid_from_its_snapshot(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two long generations in a budget for one: the preempted one resumes from its
    cached KV and recurrent snapshot (LFM2 only: hundreds of one-sequence steps)."""
    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("mlx-lfm2-preempt") / "model", arch="lfm2", seed=3,
        **ARCHS["lfm2"],
    )  # fmt: skip
    prompts = [random_prompt(70 + i, 40 + 3 * i) for i in range(2)]
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    with _mlx(model_dir) as probe:
        want = [probe.generate(p, params).token_ids for p in prompts]
        per_token = probe.adapter.kv_bytes_per_token
    with _mlx(model_dir, kv_budget_bytes=620 * per_token) as eng:
        streams = [eng.stream(p, params) for p in prompts]
        got = [[t for e in s for t in e.token_ids] for s in streams]
        sched = eng.cache_stats().scheduling
    assert sched is not None and sched.preemptions > 0, "nothing was preempted"
    assert got == want


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_kv_dtype_cached_equals_fresh(model_dir: Path, kv_dtype: str) -> None:
    prompts = [random_prompt(3, 41), random_prompt(3, 41)[:33] + random_prompt(4, 7)]
    want = _fresh(model_dir, prompts, kv_dtype=kv_dtype)
    with _mlx(model_dir, kv_dtype=kv_dtype) as eng:
        got = [eng.generate(p, GREEDY) for p in prompts]
        again = eng.generate(prompts[0], GREEDY)
        assert eng.cache_stats().runtime.kv_dtype == kv_dtype
        whole = _whole_hit(eng, prompts[0])
    assert [g.token_ids for g in got] == want and again.token_ids == want[0]
    assert got[1].cached_tokens >= 32 and again.cached_tokens == whole


def test_qwen3_next_from_ssd_after_a_restart(tmp_path: Path) -> None:
    """The other hybrid kind (gated delta rule, MoE): its snapshots too reach the SSD."""
    directory = make_tiny_model(
        tmp_path / "qwen3_next", arch="qwen3_next", seed=5, full_attention_interval=3
    )
    prompts = [random_prompt(6, 41), random_prompt(6, 41)[:27] + random_prompt(7, 9)]
    want = _fresh(directory, prompts)
    with _mlx(directory, ssd_cache_dir=tmp_path / "kv") as eng:
        assert eng.cache_stats().prefix_caching
        assert eng.generate(prompts[0], GREEDY).token_ids == want[0]
    with _mlx(directory, ssd_cache_dir=tmp_path / "kv") as eng:
        got = [eng.generate(p, GREEDY) for p in prompts]
    assert [g.token_ids for g in got] == want
    assert got[0].cached_tokens == 40 and got[0].tier_hits.get("ssd", 0) > 0
    assert got[1].cached_tokens == 24


def test_falcon_h1_stays_uncached_and_says_why(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path / "falcon_h1", arch="falcon_h1", seed=3)
    prompt = random_prompt(5, 40)
    with _mlx(directory) as eng:
        stats = eng.cache_stats()
        assert not stats.prefix_caching
        assert "cut into chunks differs" in (stats.caching_off_reason or "")
        first = eng.generate(prompt, GREEDY)
        assert eng.generate(prompt, GREEDY).token_ids == first.token_ids
        many = SamplingParams(max_tokens=6, temperature=0.9, seed=3, n=2, ignore_eos=True)
        forks = eng.generate_n(prompt, many)
        single = eng.generate(
            prompt, SamplingParams(max_tokens=6, temperature=0.9, seed=4, ignore_eos=True)
        )
        assert forks[1].token_ids == single.token_ids
