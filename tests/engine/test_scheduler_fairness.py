"""Admission across owners: the owner running the fewest goes first; when its first
waiting sequence cannot fit, other owners' sequences that fit start in turn, and it
starts once `max_head_bypass` have passed it. Prefill tokens are shared between
owners. The scheduler is bookkeeping, so most of this runs without a model; the last
test checks that `Engine.stream(owner=...)` reaches it."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from engine_helpers import random_prompt

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine.request import Request
from pagedkv.engine.sampling import Sampler
from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.sequence import Sequence


def _seq(owner: str | None, prompt: int, answer: int = 4) -> Sequence:
    """A sequence needing `prompt + answer` tokens of KV at admission."""
    req = Request(list(range(prompt)), SamplingParams(max_tokens=answer), None, owner=owner)
    decoder: Any = None  # never used: nothing is decoded here
    return Sequence(req, 0, list(req.prompt), prompt, answer, Sampler(req.params), decoder)


def _scheduler(budget: int, **config: Any) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, **config), budget)


def _admit_all(sched: Scheduler) -> list[Sequence]:
    """Admit as the worker does, until nothing more may start."""
    started = []
    while (seq := sched.next_to_admit()) is not None:
        sched.reserve(sched.admission_tokens(seq))
        sched.admit(seq)
        started.append(seq)
    return started


def _finish(sched: Scheduler, seq: Sequence) -> None:
    sched.release(sched.admission_tokens(seq))
    sched.finish(seq)


def _owners(seqs: list[Sequence]) -> list[str | None]:
    return [s.request.owner for s in seqs]


def test_another_keys_small_request_starts_while_a_large_head_waits() -> None:
    sched = _scheduler(1000)
    running = _seq("a", 496)
    big, small = _seq("a", 796), _seq("b", 96)
    for seq in (running, big, small):
        sched.add(seq)
    assert _admit_all(sched) == [running, small]  # 500 + 800 > 1000; 500 + 100 fits
    assert list(sched.waiting) == [big]
    _finish(sched, running)
    assert _admit_all(sched) == [big]


def test_owners_take_turns_and_keep_their_own_order() -> None:
    sched = _scheduler(1000)
    running = _seq("z", 596)
    sched.add(running)
    assert _admit_all(sched) == [running]
    head = _seq("a", 796)
    queue = [head, _seq("a", 6), _seq("c", 46), _seq("b", 46), _seq("c", 46)]
    queue += [_seq("b", 46), _seq("d", 46), _seq("b", 46)]
    for seq in queue:
        sched.add(seq)
    started = _admit_all(sched)
    # b, c, d in turn, then round again; key a's small one stays behind its own head.
    assert _owners(started) == ["b", "c", "d", "b", "c", "b"]
    bs = [s for s in queue if s.request.owner == "b"]
    assert [s for s in started if s.request.owner == "b"] == bs  # in their own order
    assert list(sched.waiting) == [head, queue[1]]
    for seq in [running, *started]:
        _finish(sched, seq)
    assert _admit_all(sched) == [head, queue[1]]


def test_the_head_starts_once_max_head_bypass_sequences_passed_it() -> None:
    sched = _scheduler(1000, max_head_bypass=2)
    running = _seq("z", 596)
    head = _seq("a", 796)
    others = [_seq(k, 46) for k in ("b", "c", "d", "e")]
    for seq in (running, head, *others):
        sched.add(seq)
    assert _admit_all(sched) == [running, *others[:2]]
    assert sched.next_to_admit() is None  # d and e fit, but the head has waited enough
    for seq in (running, *others[:2]):
        _finish(sched, seq)
    assert _admit_all(sched)[0] is head


def test_without_owners_or_with_no_bypass_admission_stays_in_arrival_order() -> None:
    for owners, config in (((None, None, None), {}), (("a", "b", "c"), {"max_head_bypass": 0})):
        sched = _scheduler(1000, **config)
        queue = [_seq(owners[0], 596), _seq(owners[1], 796), _seq(owners[2], 46)]
        for seq in queue:
            sched.add(seq)
        assert _admit_all(sched) == queue[:1]  # the small one waits behind the head


def test_the_key_running_fewest_takes_the_next_slot() -> None:
    sched = _scheduler(10_000)
    flood = [_seq("a", 46) for _ in range(10)]
    for seq in flood:
        sched.add(seq)
    assert _admit_all(sched) == flood[:8]  # max_num_seqs: a alone takes every slot
    late = _seq("b", 46)
    sched.add(late)
    _finish(sched, flood[0])
    assert _admit_all(sched) == [late]  # b runs none, a seven: b before a's older ones
    _finish(sched, flood[1])
    assert _admit_all(sched) == [flood[8]]  # b one, a six: a's turn, in a's own order
    assert sched.head_bypassed == 0  # a fair pick, not a bypass of a blocked head


def _prefilling(sched: Scheduler, owner: str, prompt: int) -> Sequence:
    seq = _seq(owner, prompt)
    sched.add(seq)
    assert sched.next_to_admit() is seq
    sched.reserve(sched.admission_tokens(seq))
    sched.admit(seq)
    return seq


def test_prefill_tokens_are_shared_between_keys() -> None:
    sched = _scheduler(100_000, max_num_batched_tokens=512)
    a1, a2 = _prefilling(sched, "a", 2000), _prefilling(sched, "a", 2000)
    b = _prefilling(sched, "b", 2000)
    c = _prefilling(sched, "c", 40)
    plan = dict(sched.plan())
    assert plan[c] == 40  # needs less than a third: takes all it needs
    assert plan[b] == plan[a1] == 236 and a2 not in plan  # the rest split equally
    assert sum(plan.values()) == 512


def test_one_keys_prefill_takes_the_budget_oldest_first() -> None:
    for owners in (("a", "a"), (None, None)):
        sched = _scheduler(100_000, max_num_batched_tokens=512)
        first, second = (_prefilling(sched, o, 400) for o in owners)
        assert sched.plan() == [(first, 400), (second, 112)]


def test_prefill_shares_are_max_min_fair_and_use_the_whole_budget() -> None:
    rng = random.Random(0)
    for _ in range(200):
        budget = rng.choice([64, 512, 2048])
        sched = _scheduler(10**7, max_num_batched_tokens=budget)
        for _ in range(rng.randrange(1, 8)):
            _prefilling(sched, rng.choice("abc"), rng.randrange(2, 900))
        plan = sched.plan()
        got: dict[str | None, int] = {}
        need: dict[str | None, int] = {}
        for seq in sched.running:
            need[seq.request.owner] = need.get(seq.request.owner, 0) + seq.num_pending
        for seq, take in plan:
            assert 0 < take <= seq.num_pending
            got[seq.request.owner] = got.get(seq.request.owner, 0) + take
        total = sum(got.values())
        assert total == min(budget, sum(need.values()))  # work-conserving
        for owner, n in need.items():
            if got.get(owner, 0) < n:  # left wanting: no owner got more than one token over it
                assert all(v <= got.get(owner, 0) + 1 for v in got.values()), (plan, need)


def test_engine_owner_lets_a_small_request_past_a_large_one(tiny_llama_dir: Path) -> None:
    probe = Engine.from_pretrained(str(tiny_llama_dir))
    per_token = probe.adapter.kv_bytes_per_token
    probe.close()
    # A long answer holds ~266-310 tokens; the big prompt needs 300 more, the small 14.
    config = CacheConfig(block_size=8, kv_budget_bytes=400 * per_token)
    with Engine.from_pretrained(str(tiny_llama_dir), config=config) as eng:
        long = eng.stream(
            random_prompt(1, 10), SamplingParams(max_tokens=300, ignore_eos=True), owner="a"
        )
        next(long)  # running
        big = eng.stream(
            random_prompt(2, 200), SamplingParams(max_tokens=100, ignore_eos=True), owner="a"
        )
        small = eng.generate(
            random_prompt(3, 10), SamplingParams(max_tokens=4, ignore_eos=True), owner="b"
        )
        assert small.finish_reason == "length"
        assert not long._req.results, "the small request waited for the long one to end"
        assert big._req.events.empty()  # the big one has not started
        long.cancel()
        deadline = time.monotonic() + 60
        results = [e for e in big if e.finished]
        assert results and results[0].result is not None
        assert results[0].result.finish_reason == "length"
        assert time.monotonic() < deadline
        assert eng.accounting().balanced
