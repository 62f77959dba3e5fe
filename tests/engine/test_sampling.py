"""The sampler's logits processing against a plain per-token reference, and each
sampling field end to end on a tiny model (cached == fresh with the penalties)."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine.sampling import Sampler

VOCAB = 40
FORCE = 1e4  # a logit this far above the rest makes the sampler pick its token


def forced(token: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[token] = FORCE
    return logits


def reference_scores(
    logits: Sequence[float], prompt: Sequence[int], generated: Sequence[int], p: SamplingParams
) -> list[float]:
    """logit_bias, then the penalties, one token at a time (the obviously correct form)."""
    scores = list(logits)
    for token, bias in p.logit_bias.items():
        scores[token] += bias
    seen = set(prompt) | set(generated)
    for token in range(len(scores)):
        if token in seen and p.repetition_penalty != 1.0:
            s = scores[token]
            scores[token] = s / p.repetition_penalty if s > 0 else s * p.repetition_penalty
    for token, count in Counter(generated).items():
        scores[token] -= p.frequency_penalty * count + p.presence_penalty
    return scores


def reference_probs(scores: Sequence[float], p: SamplingParams) -> list[float]:
    """Temperature, top_k, top_p, min_p, one token at a time; the sampled distribution."""
    scaled = [s / p.temperature for s in scores]
    keep = [True] * len(scaled)
    if 0 < p.top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[p.top_k - 1]
        keep = [k and s >= kth for k, s in zip(keep, scaled, strict=True)]

    def softmax(mask: list[bool]) -> list[float]:
        top = max(s for s, k in zip(scaled, mask, strict=True) if k)
        exps = [math.exp(s - top) if k else 0.0 for s, k in zip(scaled, mask, strict=True)]
        total = sum(exps)
        return [e / total for e in exps]

    if p.top_p < 1.0:
        probs = softmax(keep)
        order = sorted(range(len(scaled)), key=lambda t: -scaled[t] if keep[t] else math.inf)
        before = 0.0
        for rank, token in enumerate(order):
            if rank > 0 and before >= p.top_p:
                keep[token] = False
            before += probs[token]
    if p.min_p > 0.0:
        probs = softmax(keep)
        floor = p.min_p * max(probs)
        keep = [k and q >= floor for k, q in zip(keep, probs, strict=True)]
    return softmax(keep)


def run_sampler(p: SamplingParams, prompt: list[int], generated: list[int]) -> Sampler:
    """A sampler that has emitted `generated` after `prompt`."""
    sampler = Sampler(p, prompt=prompt)
    for token in generated:
        assert sampler.sample(forced(token)).token == token
    return sampler


@pytest.mark.parametrize("case", range(40))
def test_processing_matches_the_per_token_reference(case: int) -> None:
    rng = random.Random(case)
    p = SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([0, 1, 3, 10, VOCAB]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8, 2.0]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.4, -0.5, 2.0]),
        logit_bias=rng.choice([{}, {rng.randrange(VOCAB): rng.uniform(-100, 100)}]),
    )
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    generated = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
    sampler = run_sampler(p, prompt, generated)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(case)) * 3
    want_scores = reference_scores(logits.tolist(), prompt, generated, p)
    got_scores = sampler.adjusted(logits)
    assert got_scores.tolist() == pytest.approx(want_scores, abs=1e-4)
    want = reference_probs(want_scores, p)
    got = torch.softmax(sampler.truncated(got_scores), dim=-1)
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    greedy = run_sampler(replace(p, temperature=0.0), prompt, generated)
    best = max(range(VOCAB), key=lambda t: want_scores[t])
    assert greedy.sample(logits).token == best


def test_repetition_penalty_covers_the_prompt_and_the_answer() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, -1.05] + [-9.0] * (VOCAB - 5))
    plain = SamplingParams()
    assert Sampler(plain, prompt=[1]).sample(logits).token == 1
    penalised = SamplingParams(repetition_penalty=1.2)
    assert Sampler(penalised, prompt=[1]).sample(logits).token == 2  # 3 / 1.2 < 2.9
    assert run_sampler(penalised, [7], [1]).sample(logits).token == 2
    # A negative logit is multiplied: -1.0 * 1.2 drops below -1.05.
    neg = torch.tensor([-1.0, -1.05] + [-9.0] * (VOCAB - 2))
    assert Sampler(penalised, prompt=[0]).sample(neg).token == 1


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    logits = torch.tensor([0.0, 3.0, 2.5] + [-9.0] * (VOCAB - 3))
    presence = SamplingParams(presence_penalty=1.0)
    assert Sampler(presence, prompt=[1, 1, 1]).sample(logits).token == 1  # the prompt is free
    assert run_sampler(presence, [0], [1]).sample(logits).token == 2
    frequency = SamplingParams(frequency_penalty=0.3)
    assert run_sampler(frequency, [0], [1]).sample(logits).token == 1  # 2.7 > 2.5
    assert run_sampler(frequency, [0], [1, 1]).sample(logits).token == 2  # 2.4 < 2.5


def test_min_p_top_k_and_logit_bias_change_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -3.0] + [-20.0] * (VOCAB - 4))
    base = SamplingParams(temperature=1.0)
    support = int((torch.softmax(Sampler(base).truncated(logits), -1) > 0).sum())
    assert support == VOCAB
    min_p = Sampler(replace(base, min_p=0.2)).truncated(logits)
    assert torch.isfinite(min_p).tolist()[:4] == [True, True, False, False]  # e^-2 < 0.2
    top_k = Sampler(replace(base, top_k=3)).truncated(logits)
    assert int(torch.isfinite(top_k).sum()) == 3
    biased = Sampler(SamplingParams(logit_bias={3: 100.0}))
    assert biased.sample(logits).token == 3
    banned = Sampler(SamplingParams(logit_bias={0: -100.0}))
    assert banned.sample(logits).token == 1


def test_top_logprobs_are_the_raw_models_most_likely_tokens() -> None:
    logits = torch.tensor([0.5, 3.0, 2.0, -1.0] + [-5.0] * (VOCAB - 4))
    p = SamplingParams(logprobs=True, top_logprobs=3, repetition_penalty=5.0)
    out = Sampler(p, prompt=[1]).sample(logits)
    raw = torch.log_softmax(logits, -1)
    assert out.token == 2  # the penalty moved the choice...
    assert out.logprob == pytest.approx(float(raw[2]))  # ...not the reported distribution
    assert out.top is not None
    assert [t for t, _ in out.top] == [1, 2, 0]
    assert [lp for _, lp in out.top] == pytest.approx([float(raw[t]) for t in (1, 2, 0)])


def test_logit_bias_outside_the_vocabulary_fails_the_sample() -> None:
    with pytest.raises(ValueError, match="logit_bias names token 99"):
        Sampler(SamplingParams(logit_bias={99: 1.0})).sample(torch.zeros(VOCAB))


@pytest.mark.parametrize(
    "field, value",
    [
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("top_logprobs", 21),
        ("logit_bias", {1: 101.0}),
    ],
)
def test_out_of_range_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


# -- end to end on a tiny model ------------------------------------------------------------

BS = 8
PENALISED = SamplingParams(
    max_tokens=24,
    ignore_eos=True,
    repetition_penalty=1.5,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    logprobs=True,
)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> object:
    on = Engine.from_pretrained(
        str(tiny_llama_dir), config=CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20)
    )
    off = Engine.from_pretrained(
        str(tiny_llama_dir), config=CacheConfig(enable_prefix_caching=False)
    )
    yield on, off
    on.close()
    off.close()


@pytest.mark.parametrize(
    "params",
    [
        PENALISED,
        replace(PENALISED, repetition_penalty=1.0, presence_penalty=0.0),
        replace(PENALISED, temperature=0.8, seed=7, min_p=0.1, top_k=20),
    ],
    ids=["greedy-penalties", "greedy-frequency", "seeded-min-p-top-k"],
)
def test_penalised_output_is_the_same_from_the_cache(
    engines: tuple[Engine, Engine], params: SamplingParams
) -> None:
    on, off = engines
    prompt = _prompt(3, 37)
    want = off.generate(prompt, params)
    first, second = on.generate(prompt, params), on.generate(prompt, params)
    assert second.cached_tokens >= 32
    assert first.token_ids == second.token_ids == want.token_ids
    assert first.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert second.logprobs == pytest.approx(want.logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "change",
    [
        {"repetition_penalty": 3.0},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"logit_bias": {5: 100.0}},
    ],
)
def test_each_penalty_changes_greedy_output(
    engines: tuple[Engine, Engine], change: dict[str, object]
) -> None:
    _, off = engines
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = _prompt(4, 20)
    base = off.generate(prompt, plain).token_ids
    changed = off.generate(prompt, replace(plain, **change)).token_ids  # type: ignore[arg-type]
    assert changed != base
    if "presence_penalty" in change:  # a strong presence penalty keeps tokens distinct longer
        assert len(set(changed)) > len(set(base))


def test_sampling_fields_change_seeded_output(engines: tuple[Engine, Engine]) -> None:
    _, off = engines
    seeded = SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.5, seed=11)
    prompt = _prompt(5, 20)
    base = off.generate(prompt, seeded).token_ids
    assert off.generate(prompt, seeded).token_ids == base  # deterministic under a seed
    for change in ({"min_p": 0.5}, {"top_k": 2}):
        assert off.generate(prompt, replace(seeded, **change)).token_ids != base  # type: ignore[arg-type]


def test_top_logprobs_through_the_engine(engines: tuple[Engine, Engine]) -> None:
    on, _ = engines
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=4)
    r = on.generate(_prompt(6, 12), params)
    assert r.top_logprobs is not None and r.logprobs is not None
    assert len(r.top_logprobs) == 5
    for token, lp, top in zip(r.token_ids, r.logprobs, r.top_logprobs, strict=True):
        assert len(top) == 4
        assert top[0] == (token, pytest.approx(lp))  # greedy: the most likely is the pick
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
