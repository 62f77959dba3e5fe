"""Compact weights under the engine (`--dtype int8`: int8 weights; `--dtype int4`: 4-bit
weights over bfloat16 activations; `--dtype bfloat16`: packed for oneDNN where the CPU has
bfloat16): cached and fresh output stay identical
(RAM, SSD after a restart, many requests at once), and their blocks never mix with
float32 weights' (dtype and kernel are in the namespace)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from engine_helpers import BS, Answer, answers, random_prompt, same_answers, two_prompts

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine import SchedulerConfig

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
TOL = 2e-5  # a lone query row's attention sums in another order (see test_kv_dtype)


def _engine(model: Path, dtype: str = "int8", **cfg: object) -> Engine:
    config = CacheConfig(block_size=BS, **cfg)  # type: ignore[arg-type]
    return Engine.from_pretrained(
        str(model), config=config, dtype=dtype, scheduling=SchedulerConfig(deterministic=True)
    )


def _answers(
    eng: Engine, prompts: list[list[int]], params: SamplingParams = PARAMS
) -> list[Answer]:
    return answers(eng, prompts, params)


def _same(got: list[Answer], want: list[Answer]) -> None:
    same_answers(got, want, TOL)


@pytest.mark.parametrize("dtype", ["int8", "int4", "bfloat16"])
def test_compact_weights_cached_equal_cache_off_on_ram_and_ssd_after_a_restart(
    tiny_llama_dir: Path, tmp_path: Path, dtype: str
) -> None:
    prompts = two_prompts()
    with _engine(tiny_llama_dir, dtype, enable_prefix_caching=False) as off:
        want = _answers(off, prompts)
    with _engine(tiny_llama_dir, "float32", enable_prefix_caching=False) as plain:
        float_answers = _answers(plain, prompts)
    # the dtype really changes the numbers (else this test could not fail)
    assert max(abs(x - y) for x, y in zip(want[0][1], float_answers[0][1], strict=True)) > 10 * TOL
    cfg = {"ssd_cache_dir": tmp_path / "kv", "ssd_cache_bytes": 64 * 2**20}
    with _engine(tiny_llama_dir, dtype, **cfg) as eng:
        cold = _answers(eng, prompts)
        warm = eng.generate(prompts[0], PARAMS)
        assert warm.cached_tokens == len(prompts[0]) - 1
    _same(cold, want)
    _same([(warm.token_ids, warm.logprobs or [])], want[:1])
    with _engine(tiny_llama_dir, dtype, **cfg) as eng:  # a restart: empty RAM, the SSD tier
        got = _answers(eng, prompts)
        stats = eng.cache_stats().cache
        assert stats is not None and stats.tiers["ssd"].hits > 0
    _same(got, want)
    with _engine(tiny_llama_dir, "float32", **cfg) as other:
        assert other.generate(prompts[0], PARAMS).cached_tokens == 0


@pytest.mark.parametrize("dtype", ["int8", "int4", "bfloat16"])
def test_compact_weights_many_requests_at_once_equal_each_alone(
    tiny_llama_dir: Path, dtype: str
) -> None:
    shared = random_prompt(80, 30)
    prompts = [shared + random_prompt(81 + i, 10 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=True)
    with _engine(tiny_llama_dir, dtype, enable_prefix_caching=False) as off:
        want = _answers(off, prompts, params)
    with _engine(tiny_llama_dir, dtype) as eng:
        results: list[Answer] = [([], [])] * len(prompts)

        def run(i: int) -> None:
            results[i] = _answers(eng, prompts[i : i + 1], params)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    _same(results, want)


def test_int4_blocks_are_never_restored_into_bfloat16_weights_or_back(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """int4 computes in bfloat16 too: only the kernel in the namespace keeps them apart."""
    prompt = two_prompts()[0]
    cfg = {"ssd_cache_dir": tmp_path / "kv", "ssd_cache_bytes": 64 * 2**20}
    with _engine(tiny_llama_dir, "int4", **cfg) as eng:
        eng.generate(prompt, PARAMS)
        assert eng.generate(prompt, PARAMS).cached_tokens == len(prompt) - 1
    with _engine(tiny_llama_dir, "bfloat16", **cfg) as other:
        assert other.generate(prompt, PARAMS).cached_tokens == 0
    with _engine(tiny_llama_dir, "int4", **cfg) as eng:  # its own blocks still there
        assert eng.generate(prompt, PARAMS).cached_tokens == len(prompt) - 1


def test_a_lora_adapter_over_int4_layers_changes_the_answer_and_caches_exactly(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from fixtures_lora import make_lora

    lora = make_lora(tiny_llama_dir, tmp_path / "a", seed=1, targets=("q_proj", "down_proj"))
    prompt = two_prompts()[0]
    with _engine(tiny_llama_dir, "int4", enable_prefix_caching=False) as off:
        off.load_adapter("a", lora)
        want = off.generate(prompt, PARAMS, lora="a")
        base = off.generate(prompt, PARAMS)
    assert want.logprobs != base.logprobs  # the adapter is applied over the int4 layers
    with _engine(tiny_llama_dir, "int4") as eng:
        eng.load_adapter("a", lora)
        cold = eng.generate(prompt, PARAMS, lora="a")
        warm = eng.generate(prompt, PARAMS, lora="a")
    assert warm.cached_tokens == len(prompt) - 1
    _same([(cold.token_ids, cold.logprobs or []), (warm.token_ids, warm.logprobs or [])],
          [(want.token_ids, want.logprobs or [])] * 2)  # fmt: skip
