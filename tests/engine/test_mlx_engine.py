"""The engine on the MLX backend (mlx-cpu in CI), one set of properties over four tiny
random architectures: Llama and Qwen3 (full attention), Gemma 3 text (three layers with
a 16-token window, one global; every prompt is longer) and LFM2 (short convolutions
beside one attention layer: a recurrent state, one sequence per call). Cached == fresh
greedy output over multi-turn chats, from SSD after a restart, from Redis in a second
process, in a mixed batch against each request alone, under preemption, with kv_dtype
bfloat16 and float16; n > 1 forks the prompt (in the backend's own `copy`: MLX keeps no
spare KV); torch and MLX sharing one SSD directory and one Redis without reading each
other's blocks; the options MLX refuses, by name. What one architecture alone shows
(Qwen3-Next, Falcon-H1): tests/engine/test_mlx_engine_kinds.py.

"Fresh" is the same backend with prefix caching off: the promise is within one backend."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'pagedkv[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'pagedkv[mlx]'")

from engine_helpers import BS, GREEDY, mlx_engine, mlx_fresh, random_prompt, run_worker
from fixtures_models import make_tiny_model

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine import SchedulerConfig
from pagedkv.errors import ModelNotSupportedError
from pagedkv.server.metrics import stats_json


@dataclass(frozen=True)
class Arch:
    """A tiny architecture (`make_tiny_model`'s `arch`, `seed`, config `overrides`) and
    what its engine shows: `windows`, each KV layer's window where any is sliding (None:
    all full); `recurrent`, a recurrent state, so a hit ends at the last block boundary
    (where a snapshot was taken) and the model runs one sequence per call; `varied`,
    three seeds sample three answers not all alike (False: the tiny random model's
    next-token distribution is too peaked for that to show)."""

    seed: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    windows: tuple[int | None, ...] | None = None
    recurrent: bool = False
    varied: bool = True


ARCHS = {
    "llama": Arch(),
    "qwen3": Arch(),
    "gemma3_text": Arch(seed=3, windows=(16, 16, 16, None)),
    # mlx-lm ties LFM2's head to its embeddings and needs `block_dim`
    # (tests/model/test_mlx_agreement.py)
    "lfm2": Arch(
        seed=3,
        overrides={"tie_word_embeddings": True, "block_dim": 64},
        recurrent=True,
        varied=False,
    ),
}


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    arch: Arch

    def hit(self, num_tokens: int) -> int:
        """Tokens a cached prefix of `num_tokens` restores."""
        return num_tokens // BS * BS if self.arch.recurrent else num_tokens


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Model]:
    """Each architecture's model, written once for the module."""
    built: dict[str, Model] = {}

    def model(name: str) -> Model:
        if name not in built:
            arch = ARCHS[name]
            path = tmp_path_factory.mktemp(f"mlx-{name}") / "model"
            make_tiny_model(path, arch=name, seed=arch.seed, **arch.overrides)
            built[name] = Model(name, path, arch)
        return built[name]

    return model


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request: pytest.FixtureRequest, build: Callable[[str], Model]) -> Model:
    return build(request.param)


def test_the_layers_are_cached_and_n_samples_fork(model: Model) -> None:
    with mlx_engine(model.path) as eng:
        stats, adapter = eng.cache_stats(), eng.adapter
        assert stats.prefix_caching, stats.caching_off_reason
        assert adapter.kv_windows == (model.arch.windows or (None,) * adapter.num_kv_layers)
        assert adapter.batched is not model.arch.recurrent, adapter.unbatched_reason
        layout = adapter.state_layout
        assert (layout is not None) is model.arch.recurrent
        assert layout is None or layout.numel > 0
        prompt = random_prompt(80, 30)  # n > 1 forks the prompt's caches
        many = SamplingParams(max_tokens=8, temperature=0.9, seed=5, n=3, ignore_eos=True)
        forks = eng.generate_n(prompt, many)
        assert len(eng._worker.spares) == 0  # MLX's KV is not reused (`reuses_kv`)
        singles = [
            eng.generate(prompt, SamplingParams(max_tokens=8, temperature=0.9, seed=5 + i,
                                                ignore_eos=True))
            for i in range(3)
        ]  # fmt: skip
    assert [r.token_ids for r in forks] == [r.token_ids for r in singles]
    assert len({tuple(r.token_ids) for r in forks}) > 1 or not model.arch.varied
    assert singles[0].cached_tokens > 0


def test_multi_turn_chat_is_cached_and_equals_fresh(model: Model) -> None:
    turns = ["What does a cache keep?", "And after a restart?", "Say it as a haiku."]
    with mlx_engine(model.path) as eng, mlx_engine(model.path, enable_prefix_caching=False) as off:
        widest = max((w for w in eng.adapter.kv_windows if w is not None), default=0)
        messages: list[dict[str, str]] = []
        previous: list[int] = []
        for i, text in enumerate(turns):
            messages.append({"role": "user", "content": text})
            ids = eng.adapter.apply_chat_template(messages)
            got = eng.generate(ids, GREEDY)
            assert got.token_ids == off.generate(ids, GREEDY).token_ids, i
            if previous:  # the earlier turn's prompt is this one's start: its full blocks hit
                assert ids[: len(previous)] == previous and len(previous) > widest
                assert got.cached_tokens >= len(previous) // BS * BS > 0, i
            previous = ids
            messages.append({"role": "assistant", "content": eng.adapter.decode(got.token_ids)})
        stats = eng.cache_stats()
        assert stats.runtime.backend == "mlx-lm" and stats.requests.cached_tokens > 0


def test_ssd_after_a_restart(model: Model, tmp_path: Path) -> None:
    ssd = tmp_path / "kv"
    prompts = [random_prompt(1, 43), random_prompt(1, 43)[:30] + random_prompt(2, 11)]
    want = mlx_fresh(model.path, prompts)
    with mlx_engine(model.path, ssd_cache_dir=ssd) as eng:
        assert eng.generate(prompts[0], GREEDY).token_ids == want[0]
    with mlx_engine(model.path, ssd_cache_dir=ssd) as eng:
        first, second = (eng.generate(p, GREEDY) for p in prompts)
    assert [first.token_ids, second.token_ids] == want
    assert first.cached_tokens == model.hit(len(prompts[0]) - 1)
    assert first.tier_hits.get("ssd", 0) > 0
    assert second.cached_tokens == model.hit(30)


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "lfm2"])  # a process costs seconds
def test_redis_from_a_second_process(
    name: str, build: Callable[[str], Model], redis_url: str
) -> None:
    model = build(name)
    shared = random_prompt(11, 40)
    prompts = [shared + random_prompt(12, 6), shared + random_prompt(13, 9)]
    want = mlx_fresh(model.path, prompts)
    with mlx_engine(model.path, redis_url=redis_url) as first:
        assert first.generate(prompts[0], GREEDY).token_ids == want[0]
    cache = {"block_size": BS, "redis_url": redis_url, "backend": "mlx"}
    *results, stats = run_worker(model.path, cache, prompts)  # empty RAM, no SSD
    assert [r["token_ids"] for r in results] == want
    assert results[0]["cached_tokens"] == model.hit(len(prompts[0]) - 1)
    assert results[0]["tier_hits"].get("redis", 0) > 0
    assert results[1]["cached_tokens"] >= model.hit(len(shared))
    assert stats["stats"]["runtime"]["backend"] == "mlx-lm"


def test_mixed_batch_equals_each_request_alone(model: Model) -> None:
    """Cached prefixes of several lengths, cold prompts and a prompt in chunks, all at
    once (not under the deterministic option, which MLX refuses: prompt chunks run one
    sequence per call and decode rows batched equal alone, tests/model/test_mlx_backend.py)."""
    shared = random_prompt(10, 60)
    prompts = [shared[:k] + random_prompt(20 + k, 5) for k in (8, 17, 33, 60)]
    prompts += [random_prompt(30 + i, 9 + 4 * i) for i in range(3)]
    prompts.append(random_prompt(40, 100))  # in chunks: at most 36 tokens a step
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    scheduling = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=36)
    with mlx_engine(model.path, scheduling) as eng:
        alone = [eng.generate(p, params).token_ids for p in prompts]
        eng.clear_cache()
        eng.generate(shared, SamplingParams(max_tokens=1))
        streams = [eng.stream(p, params) for p in prompts]
        together = [[t for e in s for t in e.token_ids] for s in streams]
        assert eng.cache_stats().requests.cached_tokens > 0
    assert together == alone


@pytest.mark.parametrize("name", ["llama", "lfm2"])  # hundreds of steps each
def test_preemption_resumes_from_the_cache_exactly(
    name: str, build: Callable[[str], Model]
) -> None:
    """Two long generations in a budget for one: the preempted one resumes from its
    cached KV (and, on the hybrid, its recurrent snapshot). Admission reserves the
    prompt and 256 tokens (`engine.scheduler.GROW_TOKENS`): two run at once, and the
    first to grow past that preempts the other."""
    model = build(name)
    prompts = [random_prompt(70 + i, 40 + 3 * i) for i in range(2)]
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    with mlx_engine(model.path) as probe:
        want = [probe.generate(p, params).token_ids for p in prompts]
        per_token = probe.adapter.kv_bytes_per_token
    with mlx_engine(model.path, kv_budget_bytes=620 * per_token) as eng:
        streams = [eng.stream(p, params) for p in prompts]
        got = [[t for e in s for t in e.token_ids] for s in streams]
        sched = eng.cache_stats().scheduling
    assert sched is not None and sched.preemptions > 0, "nothing was preempted"
    assert got == want


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_kv_dtype_cached_equals_fresh(model: Model, kv_dtype: str, tmp_path: Path) -> None:
    prompts = [random_prompt(3, 41), random_prompt(3, 41)[:33] + random_prompt(4, 7)]
    want = mlx_fresh(model.path, prompts, kv_dtype=kv_dtype)
    with mlx_engine(model.path, kv_dtype=kv_dtype, ssd_cache_dir=tmp_path / "kv") as eng:
        got = [eng.generate(p, GREEDY) for p in prompts]
        again = eng.generate(prompts[0], GREEDY)
        assert eng.cache_stats().runtime.kv_dtype == kv_dtype
    assert [g.token_ids for g in got] == want and again.token_ids == want[0]
    assert got[1].cached_tokens >= 32 and again.cached_tokens == model.hit(len(prompts[0]) - 1)


def test_torch_and_mlx_never_read_each_others_blocks(
    tiny_llama_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    """One SSD directory and one Redis: blocks the torch engine stored are misses for the
    MLX engine on the same weights (its namespace names the backend), and the reverse;
    each answers as its own backend's fresh run. Explain says the identity differs."""
    ssd = tmp_path / "kv"
    prompt = random_prompt(90, 40)
    want_mlx = mlx_fresh(tiny_llama_dir, [prompt])[0]
    shared = {"block_size": BS, "ssd_cache_dir": ssd, "redis_url": redis_url}
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(**shared)) as eng:
        assert eng.adapter.backend_name == "torch"
        torch_answer = eng.generate(prompt, GREEDY)
        eng.prefix.lower.flush(5.0)  # type: ignore[union-attr]
        torch_namespace = eng.cache_stats().cache.namespace  # type: ignore[union-attr]
    with mlx_engine(tiny_llama_dir, ssd_cache_dir=ssd, redis_url=redis_url) as eng:
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


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_refused_options_say_why(name: str, build: Callable[[str], Model]) -> None:
    path = build(name).path
    with pytest.raises(ModelNotSupportedError, match="deterministic"):
        mlx_engine(path, SchedulerConfig(deterministic=True), enable_prefix_caching=False)
    with pytest.raises(ModelNotSupportedError, match="int8"):
        mlx_engine(path, kv_dtype="int8")
    with pytest.raises(ModelNotSupportedError, match="compile_decode"):
        mlx_engine(path, compile_decode=True)
    with mlx_engine(path) as eng:
        with pytest.raises(Exception, match="--backend torch"):
            eng.load_adapter("sql", str(path))
        # GET /v1/cache/stats names each refused feature with its reason
        runtime = stats_json(eng.cache_stats())["runtime"]
        assert runtime["backend"] == "mlx-lm"
        refused = runtime["refused"]
        assert set(refused) == {
            "deterministic", "kv_dtype int8", "lora", "images", "compile_decode"
        }  # fmt: skip
        assert runtime["decode"] == "eager (mlx-lm's model)"
        assert "--backend torch" in refused["lora"] and "bfloat16" in refused["kv_dtype int8"]
