"""The engine on the MLX backend (mlx-cpu in CI), tiny random Llama and Qwen3: cached ==
fresh greedy output over multi-turn chats, from SSD after a restart, from Redis in a
second process, in a mixed batch against each request alone, under preemption, with
kv_dtype bfloat16 and float16; n > 1; torch and MLX sharing one SSD directory and one
Redis without reading each other's blocks; the options MLX refuses, by name. Sliding
windows and recurrent layers: tests/engine/test_mlx_engine_kinds.py.

"Fresh" is the same backend with prefix caching off: the promise is within one backend."""

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
from pagedkv.errors import ModelNotSupportedError
from pagedkv.server.metrics import stats_json


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch = request.param
    return make_tiny_model(tmp_path_factory.mktemp(f"mlx-{arch}") / "model", arch=arch)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mlx-llama") / "model", arch="llama")


def _mlx(model: Path, scheduling: SchedulerConfig | None = None, **cache: Any) -> Engine:
    config = CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20, backend="mlx", **cache)
    return Engine.from_pretrained(str(model), config=config, scheduling=scheduling)


def _fresh(model: Path, prompts: list[list[int]], **cache: Any) -> list[list[int]]:
    """Greedy tokens on MLX with prefix caching off: what every cached run must equal."""
    with _mlx(model, enable_prefix_caching=False, **cache) as off:
        assert off.adapter.backend_name == "mlx"
        return [off.generate(p, GREEDY).token_ids for p in prompts]


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
            if previous:  # the earlier turn's prompt is this one's start: its full blocks hit
                assert ids[: len(previous)] == previous
                assert got.cached_tokens >= len(previous) // BS * BS > 0, i
            previous = ids
            messages.append({"role": "assistant", "content": eng.adapter.decode(got.token_ids)})
        stats = eng.cache_stats()
        assert stats.runtime.backend == "mlx-lm" and stats.requests.cached_tokens > 0


def test_ssd_after_a_restart(model_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "kv"
    prompts = [random_prompt(1, 43), random_prompt(1, 43)[:30] + random_prompt(2, 11)]
    want = _fresh(model_dir, prompts)
    with _mlx(model_dir, ssd_cache_dir=ssd) as eng:
        assert eng.generate(prompts[0], GREEDY).token_ids == want[0]
    with _mlx(model_dir, ssd_cache_dir=ssd) as eng:
        first, second = (eng.generate(p, GREEDY) for p in prompts)
    assert [first.token_ids, second.token_ids] == want
    assert first.cached_tokens == len(prompts[0]) - 1 and first.tier_hits.get("ssd", 0) > 0
    assert second.cached_tokens == 30


def test_redis_from_a_second_process(llama_dir: Path, redis_url: str) -> None:
    model_dir = llama_dir  # one architecture: a second process costs seconds to start
    shared = random_prompt(11, 40)
    prompts = [shared + random_prompt(12, 6), shared + random_prompt(13, 9)]
    want = _fresh(model_dir, prompts)
    with _mlx(model_dir, redis_url=redis_url) as first:
        assert first.generate(prompts[0], GREEDY).token_ids == want[0]
    cache = {"block_size": BS, "redis_url": redis_url, "backend": "mlx"}
    *results, stats = run_worker(model_dir, cache, prompts)  # empty RAM, no SSD
    assert [r["token_ids"] for r in results] == want
    assert results[0]["cached_tokens"] == len(prompts[0]) - 1
    assert results[0]["tier_hits"].get("redis", 0) > 0
    assert results[1]["cached_tokens"] >= len(shared)
    assert stats["stats"]["runtime"]["backend"] == "mlx-lm"


def test_mixed_batch_equals_each_request_alone(model_dir: Path) -> None:
    """Cached prefixes of several lengths, cold prompts and a prompt in chunks, all at
    once (not under the deterministic option, which MLX refuses: prompt chunks run one
    sequence per call and decode rows batched equal alone, tests/model/test_mlx_backend.py)."""
    shared = random_prompt(10, 60)
    prompts = [shared[:k] + random_prompt(20 + k, 5) for k in (8, 17, 33, 60)]
    prompts += [random_prompt(30 + i, 9 + 4 * i) for i in range(3)]
    prompts.append(random_prompt(40, 150))  # five chunks of 30
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


def test_preemption_resumes_from_the_cache_exactly(llama_dir: Path) -> None:
    model_dir = llama_dir  # one architecture: hundreds of steps
    # Admission reserves the prompt and 256 tokens (`engine.scheduler.GROW_TOKENS`): two
    # run at once, and the first to grow past that preempts the other.
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
def test_kv_dtype_cached_equals_fresh(model_dir: Path, kv_dtype: str, tmp_path: Path) -> None:
    prompts = [random_prompt(3, 41), random_prompt(3, 41)[:33] + random_prompt(4, 7)]
    want = _fresh(model_dir, prompts, kv_dtype=kv_dtype)
    with _mlx(model_dir, kv_dtype=kv_dtype, ssd_cache_dir=tmp_path / "kv") as eng:
        got = [eng.generate(p, GREEDY) for p in prompts]
        again = eng.generate(prompts[0], GREEDY)
        assert eng.cache_stats().runtime.kv_dtype == kv_dtype
    assert [g.token_ids for g in got] == want and again.token_ids == want[0]
    assert got[1].cached_tokens >= 32 and again.cached_tokens == len(prompts[0]) - 1


def test_n_samples_fork_the_prompt(model_dir: Path) -> None:
    prompt = random_prompt(80, 30)
    many = SamplingParams(max_tokens=10, temperature=0.9, seed=5, n=3, ignore_eos=True)
    with _mlx(model_dir) as eng:
        results = eng.generate_n(prompt, many)
        singles = [
            eng.generate(prompt, SamplingParams(max_tokens=10, temperature=0.9, seed=5 + i,
                                                ignore_eos=True))
            for i in range(3)
        ]  # fmt: skip
    assert [r.token_ids for r in results] == [s.token_ids for s in singles]
    assert len({tuple(r.token_ids) for r in results}) > 1


def test_torch_and_mlx_never_read_each_others_blocks(
    tiny_llama_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    """One SSD directory and one Redis: blocks the torch engine stored are misses for the
    MLX engine on the same weights (its namespace names the backend), and the reverse;
    each answers as its own backend's fresh run. Explain says the identity differs."""
    ssd = tmp_path / "kv"
    prompt = random_prompt(90, 40)
    want_mlx = _fresh(tiny_llama_dir, [prompt])[0]
    shared = {"block_size": BS, "ssd_cache_dir": ssd, "redis_url": redis_url}
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(**shared)) as eng:
        assert eng.adapter.backend_name == "torch"
        torch_answer = eng.generate(prompt, GREEDY)
        eng.prefix.lower.flush(5.0)  # type: ignore[union-attr]
        torch_namespace = eng.cache_stats().cache.namespace  # type: ignore[union-attr]
    with _mlx(tiny_llama_dir, ssd_cache_dir=ssd, redis_url=redis_url) as eng:
        explained = eng.explain(prompt)
        mine = eng.generate(prompt, GREEDY)
        assert eng.cache_stats().cache.namespace != torch_namespace  # type: ignore[union-attr]
        again = eng.generate(prompt, GREEDY)
        eng.prefix.lower.flush(5.0)  # type: ignore[union-attr]
    assert mine.cached_tokens == 0 and mine.token_ids == want_mlx
    assert again.cached_tokens == len(prompt) - 1  # its own blocks it does reuse
    assert explained.cached_tokens == 0 and explained.miss is not None
    assert explained.miss.reason == "identity_changed", explained.miss
    # The SSD's namespace description has no backend field; MLX's kernel names differ.
    assert "weights_kernel" in explained.miss.detail
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(**shared)) as eng:
        back = eng.generate(prompt, GREEDY)  # the torch blocks again, never MLX's
    assert back.token_ids == torch_answer.token_ids
    assert back.cached_tokens == len(prompt) - 1


def test_refused_options_say_why(model_dir: Path) -> None:
    with pytest.raises(ModelNotSupportedError, match="deterministic"):
        _mlx(model_dir, SchedulerConfig(deterministic=True), enable_prefix_caching=False)
    with pytest.raises(ModelNotSupportedError, match="int8"):
        _mlx(model_dir, kv_dtype="int8")
    with _mlx(model_dir) as eng:
        with pytest.raises(Exception, match="--backend torch"):
            eng.load_adapter("sql", str(model_dir))
        # GET /v1/cache/stats names each refused feature with its reason
        runtime = stats_json(eng.cache_stats())["runtime"]
        assert runtime["backend"] == "mlx-lm"
        refused = runtime["refused"]
        assert set(refused) == {"deterministic", "kv_dtype int8", "lora", "images"}
        assert "--backend torch" in refused["lora"] and "bfloat16" in refused["kv_dtype int8"]
