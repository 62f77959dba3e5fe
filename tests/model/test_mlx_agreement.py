"""mlx-lm's architectures against transformers' on the same float32 weights.

Each case writes a tiny random model (`make_tiny_model`), runs mlx-lm's greedy
continuation of a 48-token prompt for 24 tokens, then one transformers forward
over prompt + continuation: the two agree when transformers' argmax at every
position equals mlx-lm's (over the prompt, and over the continuation, which is
the same as both decoding the same greedy tokens). The prompt crosses a
16-token sliding window where the model has one.

AGREE cases assert agreement; DIFFER cases assert the documented difference
still exists and has the documented cause, so the table in docs/usage.md
("Architectures: mlx-lm against transformers") cannot go stale silently.

mlx-lm 0.32 reads `rope_theta` and `partial_rotary_factor` at the top level of
config.json, but transformers 5 writes them under `rope_parameters`: loaded
as is, a model whose theta is not mlx-lm's default for the architecture rotates
with the wrong frequencies (`test_rope_parameters_ignored_without_lift`). Every
other case loads with `mlx_model_config` lifting them, as the MLX backend must.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fixtures_models import make_tiny_model

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install mlx mlx-lm)")
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")

PROMPT_TOKENS = 48
NEW_TOKENS = 24
WINDOW = 16


@dataclass(frozen=True)
class Case:
    arch: str
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)
    agrees: bool = True


# Overrides beyond the fixture's defaults, and why:
# - gemma2, lfm2: mlx-lm always ties the output head to the embeddings (it rejects a
#   separate lm_head.weight), so the model is written tied;
# - lfm2: mlx-lm needs `block_dim`, which transformers 5 no longer writes;
# - qwen3_next: mlx-lm places full attention by `full_attention_interval` and ignores
#   `layer_types`; interval 3 matches the fixture's layer_types (full attention last).
CASES: dict[str, Case] = {
    "llama": Case("llama", 0),
    "qwen2": Case("qwen2", 1),
    "qwen3": Case("qwen3", 1),
    "mistral": Case("mistral", 2),
    "mistral-window16": Case("mistral", 2, {"sliding_window": WINDOW}, agrees=False),
    # with layer_types naming a full-attention layer mlx-lm honours the window
    # (transformers then loads the model as Ministral)
    "mistral-window16-layer-types": Case(
        "mistral",
        2,
        {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "qwen2-window16": Case(
        "qwen2",
        1,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0},
        agrees=False,
    ),
    "gemma3_text": Case("gemma3_text", 3),
    "gemma2": Case("gemma2", 3, {"tie_word_embeddings": True}),
    "lfm2": Case("lfm2", 4, {"tie_word_embeddings": True, "block_dim": 64}),
    "qwen3_next": Case("qwen3_next", 5, {"full_attention_interval": 3}),
}

# The windowed cases differ because mlx-lm attends to every earlier token: its output
# equals transformers' on the same weights with the window switched off.
WINDOW_OFF = {
    "mistral-window16": {"sliding_window": None},
    "qwen2-window16": {"use_sliding_window": False, "layer_types": ["full_attention"] * 2},
}


def mlx_model_config(model_dir: Path) -> dict[str, Any]:
    """The `rope_parameters` entries mlx-lm reads at the top level of config.json.

    Per-layer-type parameters (Gemma 3's) are left alone: mlx-lm's gemma3 has its
    own two thetas, whose defaults equal transformers'.
    """
    rope = json.loads((model_dir / "config.json").read_text()).get("rope_parameters") or {}
    keys = ("rope_theta", "partial_rotary_factor")
    return {k: rope[k] for k in keys if k in rope}


def _prompt() -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]


def _mlx_argmax(model_dir: Path, lift: bool = True) -> list[int]:
    """mlx-lm's greedy continuation, then its argmax at every position of prompt + continuation."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, _ = mlx_lm.load(str(model_dir), model_config=mlx_model_config(model_dir) if lift else {})
    prompt = _prompt()
    steps = generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS, sampler=make_sampler(0.0))
    continuation = [int(token) for token, _ in steps]
    logits = model(mx.array([prompt + continuation[:-1]]))
    return [int(t) for t in mx.argmax(logits[0], axis=-1).tolist()]


def _hf_argmax(model_dir: Path, tokens: list[int], **config: Any) -> list[int]:
    """transformers' argmax at every position when fed `tokens` (the same length back)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([tokens])).logits
    return [int(t) for t in logits[0].argmax(-1).tolist()]


def _fed(mlx_argmax: list[int]) -> list[int]:
    """The ids mlx-lm was fed: the prompt, then its own greedy tokens but the last."""
    return _prompt() + mlx_argmax[PROMPT_TOKENS - 1 : -1]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlx-agreement")
    return {
        name: make_tiny_model(root / name, arch=c.arch, seed=c.seed, **c.overrides)
        for name, c in CASES.items()
    }


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.agrees])
def test_agrees_with_transformers(models: dict[str, Path], name: str) -> None:
    mlx_ids = _mlx_argmax(models[name])
    hf_ids = _hf_argmax(models[name], _fed(mlx_ids))
    assert len(set(mlx_ids[PROMPT_TOKENS - 1 :])) > 1 or len(set(mlx_ids)) > 8, (
        "the test would pass on a constant output"
    )
    first = _first_difference(mlx_ids, hf_ids)
    assert first is None, (
        f"{name}: mlx-lm's argmax differs from transformers' first at position {first} "
        f"(mlx-lm {mlx_ids[first]}, transformers {hf_ids[first]}): move it to the "
        "differing rows of docs/usage.md with the reason, or fix the load"
    )


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c.agrees])
def test_sliding_window_ignored(models: dict[str, Path], name: str) -> None:
    mlx_ids = _mlx_argmax(models[name])
    fed = _fed(mlx_ids)
    windowed = _hf_argmax(models[name], fed)
    first = _first_difference(mlx_ids, windowed)
    assert first is not None and first >= WINDOW, (
        f"{name}: mlx-lm now agrees with transformers' {WINDOW}-token window (or differs "
        f"before it, at {first}): update the table in docs/usage.md"
    )
    full = _hf_argmax(models[name], fed, **WINDOW_OFF[name])
    assert _first_difference(mlx_ids, full) is None, (
        f"{name}: mlx-lm no longer matches full attention: find what it does and update the docs"
    )


def test_rope_parameters_ignored_without_lift(tmp_path: Path) -> None:
    """Loaded as is, mlx-lm's llama rotates with its default theta 10000, not the 100000
    that transformers 5 wrote under `rope_parameters` (SmolLM2's value)."""
    rope = {"rope_theta": 100000.0, "rope_type": "default"}
    model_dir = make_tiny_model(tmp_path / "m", arch="llama", rope_parameters=rope)
    lifted = _mlx_argmax(model_dir)
    assert _first_difference(lifted, _hf_argmax(model_dir, _fed(lifted))) is None
    as_is = _mlx_argmax(model_dir, lift=False)
    assert _first_difference(as_is, _hf_argmax(model_dir, _fed(as_is))) is not None, (
        "mlx-lm now reads rope_parameters: drop the lift from the MLX backend and the docs"
    )


def test_gpt_oss_not_loaded(tmp_path: Path) -> None:
    """mlx-lm refuses transformers' gpt-oss expert weights: the table says "not compared"."""
    model_dir = make_tiny_model(tmp_path / "m", arch="gpt_oss", seed=6)
    with pytest.raises(ValueError, match="experts"):
        mlx_lm.load(str(model_dir), model_config=mlx_model_config(model_dir))


def test_all_sliding_layer_types_not_loaded(tmp_path: Path) -> None:
    """mlx-lm's llama (which serves mistral) needs one full-attention layer in layer_types."""
    model_dir = make_tiny_model(
        tmp_path / "m", arch="mistral", seed=2, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="full_attention"):
        mlx_lm.load(str(model_dir), model_config=mlx_model_config(model_dir))
