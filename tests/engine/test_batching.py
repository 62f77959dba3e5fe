"""Continuous batching on tiny models: exactness, memory admission, preemption, n > 1,
faults that used to kill the worker."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine import SchedulerConfig
from pagedkv.errors import EngineClosedError, RequestTooLargeError

BS = 8
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def _released(engine: Engine) -> None:
    assert engine.prefix is not None
    engine._call(engine.prefix.pool.check)
    stats = engine.cache_stats()
    assert stats.cache is not None and stats.cache.pool.allocated == 0
    assert stats.scheduling is not None and stats.scheduling.kv_reserved_bytes == 0


def _engine(model: Path, **scheduling: object) -> Engine:
    config = CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20)
    return Engine.from_pretrained(
        str(model),
        config=config,
        scheduling=SchedulerConfig(**scheduling),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("which", ["llama", "qwen2", "sliding"])
def test_greedy_output_equals_transformers_own_forward(
    which: str, tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_sliding_dir: Path
) -> None:
    """The ragged batch against transformers' own attention, with nothing cached: each
    token is the argmax of a full forward over everything before it. An independent
    reference, here with prompts longer than the sliding model's 16-token window."""
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "sliding": tiny_sliding_dir}
    directory = model_dir[which]
    prompts = [_prompt(1, 40), _prompt(2, 7), _prompt(3, 23)]
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(12):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            want.append(ids[len(p) :])
    with _engine(directory, max_num_batched_tokens=32) as eng:
        assert eng.adapter.batched, eng.adapter.unbatched_reason
        streams = [eng.stream(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        got = [[t for e in s for t in e.token_ids] for s in streams]
    assert got == want


def test_mixed_batch_is_deterministic_per_request(tiny_llama_dir: Path) -> None:
    """Cached prefixes of different lengths, cold prompts, a long prompt in chunks and
    cancellations mid-prefill and mid-decode, all at once: under `deterministic` each
    request's greedy output equals the same request served alone."""
    shared = _prompt(10, 60)
    prompts = [shared[:k] + _prompt(20 + k, 5) for k in (8, 17, 33, 60)]
    prompts += [_prompt(30 + i, 9 + 4 * i) for i in range(3)]
    prompts.append(_prompt(40, 300))  # ten chunks of 30
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    with _engine(tiny_llama_dir, max_num_seqs=6, max_num_batched_tokens=36,
                 deterministic=True) as eng:  # fmt: skip
        alone = [eng.generate(p, params).token_ids for p in prompts]
        eng.clear_cache()
        eng.generate(shared, SamplingParams(max_tokens=1))  # some prompts now hit
        doomed_prefill = eng.stream(_prompt(50, 280), params)
        doomed_decode = eng.stream(_prompt(51, 20), SamplingParams(max_tokens=300, ignore_eos=True))
        streams = [eng.stream(p, params) for p in prompts]
        doomed_prefill.cancel()
        next(doomed_decode)
        next(doomed_decode)
        doomed_decode.cancel()
        together = [[t for e in s for t in e.token_ids] for s in streams]
        stats = eng.cache_stats()
        assert stats.scheduling is not None and stats.scheduling.deterministic
        assert stats.requests.cached_tokens > 0
        assert together == alone
        _released(eng)


def test_requests_share_steps(tiny_llama_dir: Path) -> None:
    """Eight requests decoding together take about as many steps as one."""
    with _engine(tiny_llama_dir) as eng:
        before = eng.cache_stats().scheduling.steps  # type: ignore[union-attr]
        streams = [eng.stream(_prompt(60 + i, 12), SamplingParams(max_tokens=20, ignore_eos=True))
                   for i in range(8)]  # fmt: skip
        for s in streams:
            list(s)
        steps = eng.cache_stats().scheduling.steps - before  # type: ignore[union-attr]
    assert steps < 2 * 20, f"{steps} steps for 8 x 20 tokens: the requests took turns"


def test_kv_budget_admits_preempts_and_stays_exact(tiny_llama_dir: Path) -> None:
    """A budget with room for about two requests and eight long ones at once: the
    reserved KV never passes the budget, every request finishes with the output it
    has alone, and preempted requests resume from the cache."""
    probe = _engine(tiny_llama_dir)
    per_token = probe.adapter.kv_bytes_per_token
    prompts = [_prompt(70 + i, 40 + 3 * i) for i in range(8)]
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    want = [probe.generate(p, params).token_ids for p in prompts]
    probe.close()
    budget = 700 * per_token
    config = CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20, kv_budget_bytes=budget)
    with Engine.from_pretrained(str(tiny_llama_dir), config=config) as eng:
        peak = 0
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                sched = eng.cache_stats().scheduling
                assert sched is not None
                peak = max(peak, sched.kv_reserved_bytes)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        streams = [eng.stream(p, params) for p in prompts]
        got = [[t for e in s for t in e.token_ids] for s in streams]
        done.set()
        watcher.join()
        stats = eng.cache_stats().scheduling
        assert stats is not None
        assert got == want
        assert 0 < peak <= budget
        assert stats.preemptions > 0, "the budget never ran short: the test measures nothing"
        _released(eng)


def test_a_request_that_can_never_fit_is_refused_with_numbers(tiny_llama_dir: Path) -> None:
    probe = _engine(tiny_llama_dir)
    per_token = probe.adapter.kv_bytes_per_token
    probe.close()
    config = CacheConfig(block_size=BS, kv_budget_bytes=100 * per_token)
    with Engine.from_pretrained(str(tiny_llama_dir), config=config) as eng:
        with pytest.raises(RequestTooLargeError, match=r"90 prompt tokens \+ 20 max_tokens"):
            eng.generate(_prompt(1, 90), SamplingParams(max_tokens=20))
        assert eng.generate(_prompt(1, 50), SamplingParams(max_tokens=20)).token_ids


def test_n_samples_share_the_prompt_and_match_seeded_singles(tiny_llama_dir: Path) -> None:
    prompt = _prompt(80, 30)
    many = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=3, ignore_eos=True)
    with _engine(tiny_llama_dir, deterministic=True) as eng:
        results = eng.generate_n(prompt, many)
        singles = [
            eng.generate(
                prompt, SamplingParams(max_tokens=12, temperature=0.9, seed=5 + i, ignore_eos=True)
            )
            for i in range(3)
        ]
        assert [r.index for r in results] == [0, 1, 2]
        assert [r.token_ids for r in results] == [s.token_ids for s in singles]
        assert len({tuple(r.token_ids) for r in results}) > 1
        assert eng.cache_stats().requests.generated_tokens >= 3 * 12
        _released(eng)
        with pytest.raises(ValueError, match="generate_n"):
            eng.generate(prompt, many)


def test_a_failure_while_storing_ends_nothing(tiny_llama_dir: Path) -> None:
    with _engine(tiny_llama_dir) as eng:
        assert eng.prefix is not None
        real = eng.prefix.ram.scatter
        calls = {"n": 0}

        def broken(*args: object, **kwargs: object) -> None:
            calls["n"] += 1
            raise RuntimeError("injected: out of memory while a slab grows")

        eng.prefix.ram.scatter = broken  # type: ignore[method-assign]
        prompt = _prompt(90, 30)
        first = eng.generate(prompt, GREEDY)
        assert calls["n"] > 0 and first.finish_reason == "length"
        eng.prefix.ram.scatter = real  # type: ignore[method-assign]
        assert eng.generate(prompt, GREEDY).token_ids == first.token_ids
        assert eng.cache_stats().scheduling.cache_errors > 0  # type: ignore[union-attr]
        assert eng.healthy
        _released(eng)


def test_a_failing_lookup_recomputes(tiny_llama_dir: Path) -> None:
    with _engine(tiny_llama_dir) as eng:
        assert eng.prefix is not None
        prompt = _prompt(91, 30)
        want = eng.generate(prompt, GREEDY).token_ids

        def broken(*args: object, **kwargs: object) -> object:
            raise OSError("injected: the pool's lock is poisoned")

        eng.prefix.pool.match_prefix = broken  # type: ignore[method-assign]
        again = eng.generate(prompt, GREEDY)
        assert again.token_ids == want and again.cached_tokens == 0


def test_a_dead_worker_fails_everything_and_says_so(tiny_llama_dir: Path) -> None:
    eng = _engine(tiny_llama_dir)
    stream = eng.stream(_prompt(92, 20), SamplingParams(max_tokens=5000, ignore_eos=True))
    next(stream)

    def die() -> None:
        raise SystemError("injected: a bug in the step")

    eng._worker.step = die  # type: ignore[method-assign]
    with pytest.raises(EngineClosedError, match="worker died"):
        for _ in stream:
            pass
    deadline = time.monotonic() + 5
    while eng.healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not eng.healthy
    with pytest.raises(EngineClosedError, match="worker died"):
        eng.generate([1, 2, 3], GREEDY)
    eng.close()


def test_peak_memory_stays_within_the_budget(tmp_path: Path) -> None:
    """A model whose KV is 64 KiB a token, a budget of 56 MiB of it and eight requests
    that would want 250 MiB at once: the process's peak RSS grows by at most the
    budget, the RAM tier and a 64 MiB margin for activations and the allocator."""
    import psutil
    from fixtures_models import make_tiny_model

    model = make_tiny_model(
        tmp_path / "wide", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
        hidden_size=512, head_dim=256, intermediate_size=256,
    )  # fmt: skip
    ram = 16 * 2**20
    budget = 56 * 2**20
    config = CacheConfig(block_size=BS, ram_cache_bytes=ram, kv_budget_bytes=budget)
    with Engine.from_pretrained(str(model), config=config) as eng:
        assert eng.adapter.kv_bytes_per_token == 64 * 1024
        process = psutil.Process()
        base = process.memory_info().rss
        peak = base
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, process.memory_info().rss)
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        streams = [eng.stream(_prompt(100 + i, 100), params) for i in range(8)]
        for s in streams:
            assert sum(len(e.token_ids) for e in s) == 400
        done.set()
        watcher.join()
        assert eng.cache_stats().scheduling.preemptions > 0  # type: ignore[union-attr]
    assert peak - base <= budget + ram + 64 * 2**20, f"grew {(peak - base) / 2**20:.0f} MiB"
