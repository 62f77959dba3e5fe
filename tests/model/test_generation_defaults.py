"""The sampling defaults a model recommends: read from generation_config, the bundled
model's own, and the bundled demo's answer no longer looping."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from transformers import GenerationConfig

from pagedkv.model import BUNDLED_MODEL_NAME, bundled, load_model
from pagedkv.model.generation_defaults import (
    BUNDLED_DEFAULTS,
    SamplingDefaults,
    read_sampling_defaults,
)


def test_only_the_fields_the_config_sets_count() -> None:
    qwen_like = GenerationConfig(
        do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05
    )
    got = read_sampling_defaults(qwen_like)
    assert (got.temperature, got.top_p, got.top_k, got.min_p, got.repetition_penalty) == (
        0.7,
        0.8,
        20,
        None,
        1.05,
    )
    assert "generation_config" in got.source and "top_k=20" in got.describe()
    assert read_sampling_defaults(GenerationConfig(bos_token_id=1)) == SamplingDefaults()
    assert read_sampling_defaults(None) == SamplingDefaults()
    # do_sample false asks for greedy: the sampling values are not recommendations.
    greedy = read_sampling_defaults(
        GenerationConfig(do_sample=False, temperature=0.6, repetition_penalty=1.3)
    )
    assert greedy.temperature is None and greedy.repetition_penalty == 1.3


def test_a_models_generation_config_reaches_the_adapter(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_HOME", str(tmp_path / "home"))
    assert load_model(tiny_llama_dir).sampling_defaults == SamplingDefaults()
    copy = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    config.update(do_sample=True, temperature=0.6, top_p=0.9, min_p=0.05)
    (copy / "generation_config.json").write_text(json.dumps(config))
    got = load_model(copy).sampling_defaults
    assert (got.temperature, got.top_p, got.min_p, got.top_k) == (0.6, 0.9, 0.05, None)


def _most_repeated_phrase(text: str, words: int = 3) -> int:
    tokens = re.findall(r"\w+", text.lower())
    grams = Counter(tuple(tokens[i : i + words]) for i in range(len(tokens) - words + 1))
    return max(grams.values(), default=0)


@pytest.mark.slow
def test_bundled_demo_reads_without_looping() -> None:
    """`pagedkv generate` on the bundled model, as the README shows it. Greedy decoding
    repeats "a caché lies," until max_tokens (about 20 times in 128 tokens); the
    bundled defaults end the loop."""
    bundled.ensure_bundled_model()
    assert load_model(BUNDLED_MODEL_NAME).sampling_defaults == BUNDLED_DEFAULTS
    cmd = [sys.executable, "-m", "pagedkv.cli", "generate", "--no-ssd-cache", "--seed", "0"]
    done = subprocess.run(
        [*cmd, "Write a haiku about caches"], capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and _most_repeated_phrase(done.stdout) <= 3, done.stdout
