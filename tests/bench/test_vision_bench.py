"""The vision workload at tiny size on the tiny LLaVA: every output equals the cold
replay's, reuse is measured against an ideal that tells images apart, and a model that
takes no images is refused with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.bench.vision import (
    NotAVisionModelError,
    check_takes_images,
    format_vision,
    keyed_ids,
    make_image,
    run_vision,
    vision_steps,
)
from pagedkv.cli import main
from pagedkv.config import CacheConfig


def test_the_tiny_vision_workload_runs_exact_and_near_the_ideal(tiny_llava_dir: Path) -> None:
    from pagedkv.model import load_model

    adapter = load_model(str(tiny_llava_dir), device="cpu", dtype="float32")
    result = run_vision(adapter, "tiny", CacheConfig(block_size=8), seed=0)
    _, steps = vision_steps("tiny", 0)
    assert result["requests"] == len(steps)
    assert result["outputs_identical"] == result["outputs_compared"] == len(steps)
    assert result["cold_reused_tokens"] == 0
    assert result["reuse_ratio"] is not None and result["reuse_ratio"] >= 0.9
    assert result["ttft_second_over_first_cold"] is not None
    assert "of ideal" in format_vision(result)
    # the ideal parts where two images with the same placeholders start
    eng_prompt = adapter.vision.render(
        [{"role": "user", "content": [{"type": "image", "image": make_image(1)}]}]
    )
    other = adapter.vision.render(
        [{"role": "user", "content": [{"type": "image", "image": make_image(2)}]}]
    )
    a, b = keyed_ids(eng_prompt), keyed_ids(other)
    start = eng_prompt.images[0].start
    assert a[:start] == b[:start] and a[start] != b[start]
    assert eng_prompt.token_ids == other.token_ids


def test_a_model_without_images_is_refused(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Text:
        vision = None

    with pytest.raises(NotAVisionModelError, match="needs a model that takes images"):
        check_takes_images(Text(), "m")
    code = main(["bench", "--model", str(tiny_llama_dir), "--workload", "vision", "--quick"])
    assert code == 2 and "needs a model that takes images" in capsys.readouterr().err
