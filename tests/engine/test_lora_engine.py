"""LoRA adapters in the engine: the same answers as PEFT, one batch for many adapters,
and a cache that never hands one adapter's (or the base model's) KV to another, in RAM,
on SSD after a restart and through Redis from another process."""

from __future__ import annotations

import itertools
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import BS, GREEDY, random_prompt, run_worker
from fixtures_lora import base_model, make_lora

from pagedkv import CacheConfig, Engine
from pagedkv.errors import AdapterError, UnknownAdapterError

OFF = CacheConfig(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def loras(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "a1": make_lora(tiny_llama_dir, root / "a1", seed=1),
        "a2": make_lora(tiny_llama_dir, root / "a2", seed=2, targets=("q_proj", "down_proj")),
        "a1-v2": make_lora(tiny_llama_dir, root / "a1-v2", seed=11),
    }


@pytest.fixture(scope="module")
def fresh() -> dict[tuple[str, tuple[int, ...]], list[int]]:
    """Answers of a fresh engine with caching off, memoised per (adapter dir, prompt)."""
    return {}


def reference(model: Path, memo: dict, lora_dir: Path | None, prompt: list[int]) -> list[int]:
    key = (str(lora_dir), tuple(prompt))
    if key not in memo:
        with Engine.from_pretrained(str(model), config=OFF) as eng:
            if lora_dir is not None:
                eng.load_adapter("x", lora_dir)
            memo[key] = eng.generate(
                prompt, GREEDY, lora=None if lora_dir is None else "x"
            ).token_ids
    return memo[key]


def test_answers_equal_peft(tiny_llama_dir: Path, loras: dict[str, Path]) -> None:
    from peft import PeftModel

    prompt = random_prompt(1, 21)
    with Engine.from_pretrained(str(tiny_llama_dir), config=OFF) as eng:
        for name in ("a1", "a2"):
            eng.load_adapter(name, loras[name])
        got = {name: eng.generate(prompt, GREEDY, lora=name).token_ids for name in ("a1", "a2")}
        base = eng.generate(prompt, GREEDY).token_ids
    for name in ("a1", "a2"):
        import copy

        peft = PeftModel.from_pretrained(copy.deepcopy(base_model(tiny_llama_dir)), loras[name])
        out = peft.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert got[name] == out[0, len(prompt) :].tolist(), name
        assert got[name] != base


def test_adapters_and_base_share_a_batch_and_match_alone(
    tiny_llama_dir: Path, loras: dict[str, Path]
) -> None:
    prompts = [random_prompt(10 + i, 17 + 5 * i) for i in range(6)]
    which = [None, "a1", "a2", "a1", None, "a2"]
    with Engine.from_pretrained(str(tiny_llama_dir), config=OFF) as eng:
        for name in ("a1", "a2"):
            eng.load_adapter(name, loras[name])
        pairs = list(zip(prompts, which, strict=True))
        alone = [eng.generate(p, GREEDY, lora=w).token_ids for p, w in pairs]
        steps_alone = eng._worker.steps
        streams = [eng.stream(p, GREEDY, lora=w) for p, w in pairs]
        together = [next(e for e in s if e.finished).result.token_ids for s in streams]
        steps_together = eng._worker.steps - steps_alone
    assert together == alone
    assert steps_together < steps_alone / 2, "the six requests ran in shared steps"
    assert len({tuple(t) for t in alone[:3]}) == 3


def test_prompts_never_reuse_another_adapters_blocks_in_ram(
    tiny_llama_dir: Path, loras: dict[str, Path], fresh: dict
) -> None:
    prompt = random_prompt(3, 37)
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as eng:
        for name in ("a1", "a2"):
            eng.load_adapter(name, loras[name])
        for name, lora_dir in ((None, None), ("a1", loras["a1"]), ("a2", loras["a2"])):
            first = eng.generate(prompt, GREEDY, lora=name)
            assert first.cached_tokens == 0, f"{name} reused another's blocks"
            assert first.token_ids == reference(tiny_llama_dir, fresh, lora_dir, prompt)
        for name in (None, "a1", "a2"):  # each reuses its own
            again = eng.generate(prompt, GREEDY, lora=name)
            assert again.cached_tokens == len(prompt) - 1
        explained = {n: eng.explain(prompt, lora=n).cached_tokens for n in (None, "a1", "a2")}
        assert explained == {None: len(prompt) - 1, "a1": len(prompt) - 1, "a2": len(prompt) - 1}
        eng.load_adapter("a1", loras["a1-v2"])
        assert eng.explain(prompt, lora="a1").cached_tokens == 0, "explain sees the new digest"
        eng.load_adapter("a1", loras["a1"])
        # a salt and an adapter together: neither's blocks serve the other
        salted = eng.generate(prompt, GREEDY, lora="a1", cache_salt="tenant")
        assert salted.cached_tokens == 0


def test_same_name_reload_with_new_weights_never_reuses(
    tiny_llama_dir: Path, loras: dict[str, Path], fresh: dict
) -> None:
    prompt = random_prompt(4, 33)
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as eng:
        eng.load_adapter("a1", loras["a1"])
        old = eng.generate(prompt, GREEDY, lora="a1")
        assert eng.generate(prompt, GREEDY, lora="a1").cached_tokens == len(prompt) - 1
        eng.load_adapter("a1", loras["a1-v2"])  # same name, other weights
        new = eng.generate(prompt, GREEDY, lora="a1")
        assert new.cached_tokens == 0
        assert new.token_ids == reference(tiny_llama_dir, fresh, loras["a1-v2"], prompt)
        assert new.token_ids != old.token_ids
        eng.load_adapter("a1", loras["a1"])  # back to the first: its blocks are its own
        assert eng.generate(prompt, GREEDY, lora="a1").token_ids == old.token_ids


def test_no_reuse_across_adapters_on_ssd_after_a_restart(
    tiny_llama_dir: Path, loras: dict[str, Path], fresh: dict, tmp_path: Path
) -> None:
    prompt = random_prompt(5, 41)
    cfg = CacheConfig(block_size=BS, ssd_cache_dir=str(tmp_path / "ssd"))
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as eng:
        eng.load_adapter("a1", loras["a1"])
        eng.generate(prompt, GREEDY, lora="a1")
    with Engine.from_pretrained(str(tiny_llama_dir), config=cfg) as eng:  # empty RAM
        eng.load_adapter("a2", loras["a2"])
        eng.load_adapter("a1", loras["a1-v2"])  # the old name, other weights
        for name, lora_dir in ((None, None), ("a2", loras["a2"]), ("a1", loras["a1-v2"])):
            r = eng.generate(prompt, GREEDY, lora=name)
            assert r.cached_tokens == 0, f"{name} reused a1's blocks from the SSD"
            assert r.token_ids == reference(tiny_llama_dir, fresh, lora_dir, prompt)
        eng.load_adapter("a1", loras["a1"])
        r = eng.generate(prompt, GREEDY, lora="a1")
        assert r.cached_tokens == len(prompt) - 1 and r.tier_hits.get("ssd", 0) > 0
        assert r.token_ids == reference(tiny_llama_dir, fresh, loras["a1"], prompt)


@pytest.mark.redis
def test_no_reuse_across_adapters_through_redis_from_another_process(
    tiny_llama_dir: Path, loras: dict[str, Path], fresh: dict, redis_url: str
) -> None:
    prompt = random_prompt(6, 40)
    cache = {"block_size": BS, "redis_url": redis_url}
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(**cache)) as eng:
        eng.load_adapter("a1", loras["a1"])
        eng.generate(prompt, GREEDY, lora="a1")
    spec_loras = {"a1": str(loras["a1"]), "a2": str(loras["a2"])}
    *results, _ = run_worker(
        tiny_llama_dir, cache, [prompt] * 3, loras=spec_loras, adapters=[None, "a2", "a1"]
    )
    assert [r["cached_tokens"] for r in results[:2]] == [0, 0], "base and a2 took a1's blocks"
    assert results[2]["cached_tokens"] == len(prompt) - 1
    assert results[2]["tier_hits"].get("redis", 0) > 0
    for r, lora_dir in zip(results, (None, loras["a2"], loras["a1"]), strict=True):
        assert r["token_ids"] == reference(tiny_llama_dir, fresh, lora_dir, prompt)


def test_randomized_adapter_switching_soak(
    tiny_llama_dir: Path, loras: dict[str, Path], fresh: dict
) -> None:
    """Requests for random adapters over prompts sharing prefixes, in concurrent waves,
    with a same-name reload in the middle: every answer equals a fresh engine's."""
    rng = random.Random(33)
    stems = [random_prompt(40 + i, 24) for i in range(3)]
    choices: list[tuple[str | None, str | None]] = [(None, None), ("a1", "a1"), ("a2", "a2")]
    wrong = []
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as eng:
        eng.load_adapter("a1", loras["a1"])
        eng.load_adapter("a2", loras["a2"])
        for wave in range(4):
            if wave == 2:
                eng.load_adapter("a1", loras["a1-v2"])
                choices[1] = ("a1", "a1-v2")
            batch = []
            for _ in range(5):
                name, dir_key = rng.choice(choices)
                prompt = rng.choice(stems) + random_prompt(rng.randrange(1000), rng.randrange(1, 9))
                batch.append((name, dir_key, prompt, eng.stream(prompt, GREEDY, lora=name)))
            for name, dir_key, prompt, stream in batch:
                got = next(e for e in stream if e.finished).result.token_ids
                want = reference(tiny_llama_dir, fresh, loras.get(dir_key or ""), prompt)
                if got != want:
                    wrong.append((wave, name, prompt))
    assert wrong == []


def test_unload_lets_running_requests_finish_and_refuses_new_ones(
    tiny_llama_dir: Path, loras: dict[str, Path], fresh: dict
) -> None:
    prompt = random_prompt(7, 20)
    params = GREEDY
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as eng:
        eng.load_adapter("a1", loras["a1"])
        held = eng.adapters.acquire("a1")
        eng.adapters.release(held)
        stream = eng.stream(prompt, params, lora="a1")
        first = next(stream)  # running
        eng.unload_adapter("a1")
        rest = next(e for e in stream if e.finished).result
        assert first.token_ids[:1] == rest.token_ids[:1]
        assert rest.token_ids == reference(tiny_llama_dir, fresh, loras["a1"], prompt)
        with pytest.raises(UnknownAdapterError, match="no LoRA adapter named 'a1'"):
            eng.generate(prompt, GREEDY, lora="a1")
        with pytest.raises(UnknownAdapterError):
            eng.unload_adapter("a1")
        assert eng.adapter_names() == []
        eng._call(eng.adapters.collect)
        assert not eng.adapter.lora_layers.installed(held), "its products were freed"


def test_a_bad_adapter_is_refused_and_the_engine_keeps_serving(
    tiny_llama_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    with Engine.from_pretrained(
        str(tiny_llama_dir), config=CacheConfig(block_size=BS), max_lora_rank=2
    ) as eng:
        with pytest.raises(AdapterError, match="above --max-lora-rank 2"):
            eng.load_adapter("a1", loras["a1"])
        with pytest.raises(AdapterError, match="is not a directory"):
            eng.load_adapter("a1", tmp_path / "missing")
        with pytest.raises(AdapterError, match="not allowed"):
            eng.load_adapter("base:a1", loras["a1"])
        assert eng.adapter_names() == []
        assert len(eng.generate(random_prompt(8, 9), GREEDY).token_ids) == 8


def test_loading_runs_off_the_worker(tiny_llama_dir: Path, loras: dict[str, Path]) -> None:
    """Reading and preparing happen on another thread; the worker only installs (a
    dictionary update), so a stream decoding meanwhile keeps its pace."""
    long = GREEDY.__class__(max_tokens=60, ignore_eos=True)
    with Engine.from_pretrained(str(tiny_llama_dir), config=OFF) as eng:
        stream = eng.stream(random_prompt(9, 10), long)
        stamps: list[float] = []
        done = threading.Event()

        def read() -> None:
            for _ in stream:
                stamps.append(time.perf_counter())
            done.set()

        reader = threading.Thread(target=read)
        reader.start()
        while len(stamps) < 5:
            time.sleep(0.001)
        info = eng.load_adapter("a1", loras["a1"])
        reader.join(60)
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps))
    median = gaps[len(gaps) // 2]
    assert info["install_s"] < median, (info["install_s"], median)
