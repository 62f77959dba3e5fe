"""The hostile soak of benchmarks/bench_hostile_soak.py, a minute long on a tiny model:
two normal keys keep their latency, /health stays 200, nothing leaks, nothing 500s."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from server_proc import tools_model_dir

__all__ = ["tools_model_dir"]  # a fixture, used by name

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_hostile_soak.py"


def load_bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_hostile_soak", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_hostile_soak_one_minute(tools_model_dir: Path) -> None:
    verdict = load_bench().soak(str(tools_model_dir), seconds=25)
    assert verdict.ok, "\n".join(verdict.lines)
