"""The agent-reasoning workload: its shape, and on a tiny model that reasoning-aware
storing brings reuse to the ideal that holds each turn in the next request's form."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pagedkv import CacheConfig
from pagedkv.bench.run import run_workload
from pagedkv.bench.workloads import TOOL_STEPS, build_workload


def test_a_task_then_tool_results_under_the_reasoning_template() -> None:
    wl = build_workload("agent-reasoning", "tiny", seed=0)
    assert wl.chat_template is not None and "</think>" in wl.chat_template
    assert wl.ideal_next_form
    for step in wl.steps:
        role = step.messages[-1]["role"]
        assert role == ("user" if step.turn % (TOOL_STEPS + 1) == 0 else "tool")


def _run(model: Path, mode: str) -> dict[str, Any]:
    from pagedkv.model import load_model

    adapter = load_model(str(model), device="cpu", dtype="float32")
    config = CacheConfig(block_size=8, ram_cache_bytes="64MB", reasoning_cache=mode,
                         hash_seed=os.urandom(16))  # fmt: skip
    own = adapter.tokenizer.chat_template
    result = run_workload(adapter, build_workload("agent-reasoning", "tiny", seed=1), config)
    assert adapter.tokenizer.chat_template == own, "the model's own template is put back"
    return result


@pytest.mark.slow
def test_storing_reaches_the_ideal_and_answers_as_fresh(tiny_qwen2_dir: Path) -> None:
    off, on = _run(tiny_qwen2_dir, "off"), _run(tiny_qwen2_dir, "on")
    assert off["ideal_reused_tokens"] == on["ideal_reused_tokens"] > 0
    assert off["reuse_ratio"] < 0.98  # today's figure: the stripped turns are recomputed
    assert on["reuse_ratio"] >= 0.98
    assert on["next_turn_stores"].get("queued", 0) > 0
    for r in (off, on):
        assert r["outputs_identical"] == r["outputs_compared"] == r["requests"]
