"""Background requests (the after-turn store of reasoning-aware storing) in the
scheduler: they wait behind client requests, prefill after them, and a client
request that shares their prefix promotes the one computing it and waits for it."""

from __future__ import annotations

from typing import Any

from pagedkv import SamplingParams
from pagedkv.engine.request import Request
from pagedkv.engine.sampling import Sampler
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.sequence import Sequence


def _seq(prompt: list[int], background: bool = False) -> Sequence:
    req = Request(prompt, SamplingParams(max_tokens=1), None, background=background,
                  prefill_only=background)  # fmt: skip
    req.num_open = 1
    decoder: Any = None
    return Sequence(req, 0, list(prompt), len(prompt), 1, Sampler(req.params), decoder)


def _admit_all(sched: Scheduler) -> list[Sequence]:
    started = []
    while (seq := sched.next_to_admit()) is not None:
        sched.reserve(sched.admission_tokens(seq))
        sched.admit(seq)
        started.append(seq)
    return started


def _scheduler() -> Scheduler:
    sched = Scheduler(SchedulerConfig(max_num_seqs=8), 100_000)
    sched.min_shared_tokens = 16
    return sched


def test_client_requests_go_ahead_of_background_ones_and_prefill_first() -> None:
    sched = _scheduler()
    bg = _seq(list(range(100, 200)), background=True)
    client = _seq(list(range(300, 340)))
    sched.add(bg)
    sched.add(client)
    assert list(sched.waiting) == [client, bg]
    assert _admit_all(sched) == [client, bg]
    assert [s for s, _ in sched.plan()] == [client, bg]  # the client's chunk first


def test_a_request_sharing_a_background_prefix_promotes_it_and_waits_for_it() -> None:
    sched = _scheduler()
    shared = list(range(100, 164))
    other_bg = _seq(list(range(500, 600)), background=True)
    bg = _seq([*shared, 7, 8], background=True)
    sched.add(other_bg)
    sched.add(bg)
    turn = _seq([*shared, 9, 9, 9])
    sched.add(turn)
    assert list(sched.waiting) == [bg, turn, other_bg]
    assert not bg.request.background and turn.wait_for is bg.request
    # The turn waits while its prefix is computed; what is not held may start.
    assert _admit_all(sched) == [bg, other_bg]
    bg.request.num_open = 0  # the prefill ended (cached, or failed: either way, go)
    sched.finish(bg)
    assert _admit_all(sched) == [turn]


def test_a_shorter_overlap_is_no_reason_to_wait() -> None:
    sched = _scheduler()
    bg = _seq(list(range(100, 200)), background=True)
    sched.add(bg)
    near = _seq(list(range(100, 110)) + [1] * 30)  # 10 shared tokens: under a block
    sched.add(near)
    # Another session of the key, sharing the system prompt (the first 80 tokens) only.
    sibling = _seq(list(range(100, 180)) + [2] * 40)
    sched.add(sibling)
    assert near.wait_for is None and sibling.wait_for is None and bg.request.background
