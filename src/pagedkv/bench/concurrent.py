"""Run a workload's steps with several users at once, each session in its own order."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from pagedkv.bench.workloads import Step


def run_steps(
    steps: Sequence[Step], indices: Sequence[int], concurrency: int, run: Callable[[int], None]
) -> None:
    """Call `run(i)` for every index in `indices`, up to `concurrency` at once.

    A session's steps run one after another, in order (each needs the answer
    to the one before); steps of different sessions overlap. Steps start in
    workload order whenever their session is free, so `concurrency=1` is the
    plain sequential run. The first exception stops new steps and is raised
    once the running ones end.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    todo = list(indices)
    cond = threading.Condition()
    busy: set[int] = set()
    errors: list[BaseException] = []

    def take() -> int | None:
        for pos, i in enumerate(todo):
            session = steps[i].session
            if session in busy:
                continue
            if any(steps[j].session == session for j in todo[:pos]):
                continue  # an earlier step of this session has not started yet
            todo.pop(pos)
            busy.add(session)
            return i
        return None

    def worker() -> None:
        while True:
            with cond:
                while True:
                    if errors or not todo:
                        return
                    i = take()
                    if i is not None:
                        break
                    cond.wait()
            try:
                run(i)
            except BaseException as exc:  # stop the others, raise in the caller
                with cond:
                    errors.append(exc)
            finally:
                with cond:
                    busy.discard(steps[i].session)
                    cond.notify_all()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
