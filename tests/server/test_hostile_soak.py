"""The hostile soak of benchmarks/bench_hostile_soak.py, two 12 s phases (quiet, then
hostile) on a tiny model:
two normal keys are answered, /health stays 200, nothing leaks, nothing 500s, nothing
stays held.

The benchmark's latency check (normal p50 within 3x quiet) is not asserted here: it
is issue 29's unmet target (docs/benchmarks.md, "Hostile soak"), and on two cores
shared with the clients the ratio varies by host from 2.3x to 14x on the same code
(the server's Python threads wait on one another's GIL while bodies are parsed). The
test prints it; a key starved of the engine would fail "normal keys all 200"."""

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


def test_hostile_soak_short(tools_model_dir: Path) -> None:
    verdict = load_bench().soak(str(tools_model_dir), seconds=12)
    print("\n".join(verdict.lines))
    assert LATENCY in verdict.checks  # the one check left out, by its name
    failed = [name for name, ok in verdict.checks.items() if not ok and name != LATENCY]
    assert not failed, "\n".join(verdict.lines)


LATENCY = "normal p50 within 3x quiet"
