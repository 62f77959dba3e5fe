"""Compact KV (`kv_dtype`) under the engine: cached and fresh output stay identical on
every tier and after a restart, and the tiers really hold the compact bytes.

Greedy tokens alone rarely notice a rounding difference on a tiny model, so the
exactness tests also compare log-probabilities, under the deterministic scheduler
(padded batches: a row's linear layers round the same however many rows ran with
it). They agree to `TOL`, not bit for bit, with `auto` as well: the attention
kernel sums a lone query row in another order than a prefill's rows (measured:
<= 2e-6). Each format moves them by 1e-4 or more (`test_each_dtype_rounds_differently`),
so a path that rounded only what it stored, or restored other bytes, fails here.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from engine_helpers import BS, Answer, answers, random_prompt, same_answers, two_prompts

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine import SchedulerConfig
from pagedkv.storage.redis.format import decode_frame
from pagedkv.storage.ssd.format import decode_file
from pagedkv.storage.ssd.maintenance import cache_stats

KV_DTYPES = ["auto", "bfloat16", "float16", "int8"]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
TOL = 2e-5
PER_TOKEN = {"auto": 512, "bfloat16": 256, "float16": 256, "int8": 160}
STORED = {"auto": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.uint8}  # fmt: skip


def _engine(model: Path, kv_dtype: str, **cfg: object) -> Engine:
    config = CacheConfig(block_size=BS, kv_dtype=kv_dtype, **cfg)  # type: ignore[arg-type]
    return Engine.from_pretrained(
        str(model), config=config, scheduling=SchedulerConfig(deterministic=True)
    )


def _answers(
    eng: Engine, prompts: list[list[int]], params: SamplingParams = PARAMS
) -> list[Answer]:
    return answers(eng, prompts, params)


def _same(got: list[Answer], want: list[Answer]) -> None:
    same_answers(got, want, TOL)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[str, list[tuple[list[int], list[float]]]]:
    """Cache-off answers, with their log-probs, per kv_dtype."""
    out = {}
    for kv_dtype in KV_DTYPES:
        with _engine(tiny_llama_dir, kv_dtype, enable_prefix_caching=False) as off:
            out[kv_dtype] = _answers(off, two_prompts())
    return out


def test_each_dtype_rounds_differently(reference: dict[str, list]) -> None:
    """The formats really change the numbers attention sees (else the exactness tests
    below would pass for a format that silently kept float32)."""
    first = [reference[k][0][1] for k in KV_DTYPES]
    for i, a in enumerate(first):
        for b in first[i + 1 :]:
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) > 10 * TOL
    # ...but by little: the greedy answer of a tiny model survives every format
    assert len({tuple(reference[k][0][0]) for k in KV_DTYPES}) == 1


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_ram_hits_equal_cache_off_bit_for_bit(
    tiny_llama_dir: Path, kv_dtype: str, reference: dict[str, list]
) -> None:
    prompts = two_prompts()
    with _engine(tiny_llama_dir, kv_dtype) as eng:
        cold = _answers(eng, prompts)
        warm = eng.generate(prompts[0], PARAMS)
        assert warm.cached_tokens == len(prompts[0]) - 1
        assert eng.prefix is not None
        assert eng.prefix.ram.slabs[0].dtype == STORED[kv_dtype]
        per_token = eng.cache_stats().cache.bytes_per_token  # type: ignore[union-attr]
    _same(cold, reference[kv_dtype])
    _same([(warm.token_ids, warm.logprobs or [])], reference[kv_dtype][:1])
    # tiny llama: 2 layers x K,V x 2 heads x 16 dims; int8 rows are 16 bytes + a 4-byte scale
    assert per_token == PER_TOKEN[kv_dtype]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_ssd_restart_equals_cache_off_and_stores_compact_files(
    tiny_llama_dir: Path, tmp_path: Path, kv_dtype: str, reference: dict[str, list]
) -> None:
    ssd = tmp_path / "kv"
    prompts = two_prompts()
    cfg = {"ssd_cache_dir": ssd, "ssd_cache_bytes": 64 * 2**20}
    with _engine(tiny_llama_dir, kv_dtype, **cfg) as eng:
        eng.generate(prompts[0], PARAMS)
        namespace = eng.prefix.namespace  # type: ignore[union-attr]
    # `pagedkv cache stats`: the file bytes per token, KV plus ~40 B/token of header
    # and token ids at this tiny block size
    on_disk = cache_stats(ssd).bytes_per_token[namespace]
    assert PER_TOKEN[kv_dtype] < on_disk < PER_TOKEN[kv_dtype] + 100
    files = sorted(ssd.rglob("*.safetensors"))
    assert files
    block, _ = decode_file(torch.frombuffer(bytearray(files[0].read_bytes()), dtype=torch.uint8),
                           bytes.fromhex(files[0].stem))  # fmt: skip
    assert block.kv.dtype == STORED[kv_dtype]
    assert block.num_bytes == block.meta.num_tokens * PER_TOKEN[kv_dtype]
    with _engine(tiny_llama_dir, kv_dtype, **cfg) as eng:  # a new engine: empty RAM
        got = _answers(eng, prompts)
        stats = eng.cache_stats().cache
        assert stats is not None and stats.tiers["ssd"].hits > 0
    _same(got, reference[kv_dtype])
    with _engine(tiny_llama_dir, "auto" if kv_dtype != "auto" else "int8", **cfg) as other:
        miss = other.generate(prompts[0], PARAMS)
    assert miss.cached_tokens == 0, "blocks of another kv_dtype must never be found"


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_redis_hits_equal_cache_off(
    tiny_llama_dir: Path, redis_url: str, kv_dtype: str, reference: dict[str, list]
) -> None:
    prompts = two_prompts()
    with _engine(tiny_llama_dir, kv_dtype, redis_url=redis_url) as eng:
        eng.clear_cache()
        eng.generate(prompts[0], PARAMS)
        assert eng.prefix is not None
        eng.prefix.lower.tiers[0].flush()
        tier = eng.prefix.lower.tiers[0]
        block_hash = eng.prefix.hasher.chain(prompts[0]).hashes[0]
        value = tier._write_client.get(tier._key(block_hash))  # type: ignore[attr-defined]
        frame = decode_frame(value, block_hash, eng.prefix.namespace)
        assert frame is not None and frame.kv.dtype == STORED[kv_dtype]
    with _engine(tiny_llama_dir, kv_dtype, redis_url=redis_url) as eng:  # empty RAM
        got = _answers(eng, prompts)
        stats = eng.cache_stats().cache
        assert stats is not None and stats.tiers["redis"].hits > 0
    _same(got, reference[kv_dtype])


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_batched_preempting_requests_stay_exact(tiny_llama_dir: Path, kv_dtype: str) -> None:
    """Many requests at once in the ragged batch, in a KV budget that forces preemption
    (a preempted request resumes from its cached compact KV): each answer equals the
    one it has alone."""
    shared = random_prompt(80, 30)
    prompts = [shared + random_prompt(81 + i, 10 + 3 * i) for i in range(6)]
    params = SamplingParams(max_tokens=300, ignore_eos=True, logprobs=True)
    with _engine(tiny_llama_dir, kv_dtype, enable_prefix_caching=False) as off:
        want = _answers(off, prompts, params)
        per_token = off.adapter.kv_bytes_per_token
    with _engine(tiny_llama_dir, kv_dtype, kv_budget_bytes=700 * per_token) as eng:
        results: list[Answer] = [([], [])] * len(prompts)

        def run(i: int) -> None:
            results[i] = _answers(eng, prompts[i : i + 1], params)[0]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sched = eng.cache_stats().scheduling
        assert sched is not None and sched.preemptions > 0
    _same(results, want)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_sliding_window_model_with_compact_kv_stays_exact_after_a_restart(
    kv_dtype: str, tmp_path: Path
) -> None:
    """Compact KV and windowed restores together: a Gemma-3-style model (sliding and
    global layers) answers a conversation longer than its window as it does with the
    cache off, from RAM and from SSD after a restart."""
    from fixtures_models import make_tiny_model

    model = make_tiny_model(tmp_path / "gemma3", arch="gemma3_text", seed=7)
    shared = random_prompt(11, 45)  # several 16-token windows
    prompts = [shared + random_prompt(12, 6), shared[:37] + random_prompt(13, 9)]
    with _engine(model, kv_dtype, enable_prefix_caching=False) as off:
        want = _answers(off, prompts)
    ssd = tmp_path / "ssd"
    with _engine(model, kv_dtype, ssd_cache_dir=ssd) as eng:
        assert eng.prefix is not None, eng.cache_stats().caching_off_reason
        _answers(eng, prompts[:1])
        _same(_answers(eng, prompts), want)
        eng.prefix.lower.tiers[0].flush()
    with _engine(model, kv_dtype, ssd_cache_dir=ssd) as again:
        got = []
        for p in prompts:
            r = again.generate(p, PARAMS)
            assert r.cached_tokens > 0
            assert r.logprobs is not None
            got.append((r.token_ids, r.logprobs))
        _same(got, want)
