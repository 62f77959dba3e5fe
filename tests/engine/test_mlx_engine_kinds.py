"""The engine on the MLX backend with the layer kinds one architecture alone shows:
Qwen3-Next (gated delta rule, MoE) from SSD after a restart; Falcon-H1 stays uncached,
its reason measured (mlx-lm's Mamba-2 scan rounds otherwise in chunks). Sliding windows
and LFM2's short convolutions run the shared properties with Llama and Qwen3:
tests/engine/test_mlx_engine.py.

"Fresh" is the same backend with prefix caching off (`model.mlx.layers`)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("mlx.core", reason="MLX is not installed: pip install 'pagedkv[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'pagedkv[mlx]'")

from engine_helpers import GREEDY, mlx_engine, mlx_fresh, random_prompt
from fixtures_models import make_tiny_model

from pagedkv import SamplingParams


def test_qwen3_next_from_ssd_after_a_restart(tmp_path: Path) -> None:
    """The other hybrid kind (gated delta rule, MoE): its snapshots too reach the SSD."""
    directory = make_tiny_model(
        tmp_path / "qwen3_next", arch="qwen3_next", seed=5, full_attention_interval=3
    )
    prompts = [random_prompt(6, 41), random_prompt(6, 41)[:27] + random_prompt(7, 9)]
    want = mlx_fresh(directory, prompts)
    with mlx_engine(directory, ssd_cache_dir=tmp_path / "kv") as eng:
        assert eng.cache_stats().prefix_caching
        assert eng.generate(prompts[0], GREEDY).token_ids == want[0]
    with mlx_engine(directory, ssd_cache_dir=tmp_path / "kv") as eng:
        got = [eng.generate(p, GREEDY) for p in prompts]
    assert [g.token_ids for g in got] == want
    assert got[0].cached_tokens == 40 and got[0].tier_hits.get("ssd", 0) > 0
    assert got[1].cached_tokens == 24


def test_falcon_h1_stays_uncached_and_says_why(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path / "falcon_h1", arch="falcon_h1", seed=3)
    prompt = random_prompt(5, 40)
    with mlx_engine(directory) as eng:
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
