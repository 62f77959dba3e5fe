"""Several users at once over a workload: each session in order, sessions overlapping."""

from __future__ import annotations

import threading
import time

import pytest

from pagedkv.bench.concurrent import run_steps
from pagedkv.bench.workloads import Step


def _steps(sessions: list[int]) -> list[Step]:
    turns: dict[int, int] = {}
    out = []
    for s in sessions:
        out.append(Step(s, turns.get(s, 0), (), 4))
        turns[s] = turns.get(s, 0) + 1
    return out


def test_sessions_stay_in_order_and_overlap() -> None:
    steps = _steps([0, 1, 2, 0, 1, 2, 0, 1, 2, 3])
    lock = threading.Lock()
    running: set[int] = set()
    started: list[int] = []
    peak = 0

    def run(i: int) -> None:
        nonlocal peak
        with lock:
            assert steps[i].session not in running, "two steps of one session at once"
            running.add(steps[i].session)
            started.append(i)
            peak = max(peak, len(running))
        time.sleep(0.01)
        with lock:
            running.discard(steps[i].session)

    run_steps(steps, range(len(steps)), 3, run)
    assert sorted(started) == list(range(len(steps)))
    for session in range(4):
        mine = [i for i in started if steps[i].session == session]
        assert mine == sorted(mine)
    assert peak == 3


def test_one_user_is_the_sequential_run() -> None:
    steps = _steps([0, 1, 0, 2, 1])
    order: list[int] = []
    run_steps(steps, range(len(steps)), 1, order.append)
    assert order == list(range(len(steps)))


def test_the_first_error_stops_new_steps_and_is_raised() -> None:
    steps = _steps(list(range(20)))
    ran: list[int] = []

    def run(i: int) -> None:
        ran.append(i)
        if i == 2:
            raise RuntimeError("step 2 failed")

    with pytest.raises(RuntimeError, match="step 2"):
        run_steps(steps, range(len(steps)), 2, run)
    assert len(ran) < len(steps)
