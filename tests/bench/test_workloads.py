"""Bench workloads are reproducible, and the ideal cache counts exactly what could be reused."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.bench import WORKLOADS, IdealCache, PrefixTrie, build_workload
from pagedkv.bench.workloads import SIZES


def brute_force_ideal(requests: list[tuple[list[int], list[int]]]) -> list[int]:
    """The obviously correct ideal: compare each prompt, token by token, with every
    sequence computed before it (prompt + generated minus its last token)."""
    computed: list[list[int]] = []
    out = []
    for prompt, generated in requests:
        best = 0
        for seq in computed:
            n = 0
            while n < len(prompt) and n < len(seq) and prompt[n] == seq[n]:
                n += 1
            best = max(best, n)
        out.append(max(0, min(best, len(prompt) - 1)))
        computed.append(prompt + generated[:-1])
    return out


def trie_ideal(requests: list[tuple[list[int], list[int]]]) -> list[int]:
    ideal = IdealCache()
    return [ideal.observe(p, g) for p, g in requests]


# -- workloads ----------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_is_a_function_of_its_seed(name: str, size: str) -> None:
    a, b = build_workload(name, size, seed=3), build_workload(name, size, seed=3)
    assert a == b
    assert a.steps != build_workload(name, size, seed=4).steps


@pytest.mark.parametrize("name", WORKLOADS)
def test_sessions_start_with_the_shared_prefix_and_keep_their_turn_order(name: str) -> None:
    wl = build_workload(name, "quick", seed=0)
    seen: dict[int, int] = {}
    system_prompts = set()
    for step in wl.steps:
        assert step.turn == seen.get(step.session, -1) + 1, "a session's turns run in order"
        seen[step.session] = step.turn
        if step.turn == 0:
            assert step.messages[0]["role"] == "system"
            system_prompts.add(step.messages[0]["content"])
        roles = ("system", "user", "tool") if name == "agent-reasoning" else ("system", "user")
        assert all(m["role"] in roles for m in step.messages)
        assert step.messages[-1]["role"] in roles[1:]
    assert len(system_prompts) == 1, "every session shares one system prompt / document"
    assert wl.num_sessions == len(seen)


def test_chat_interleaves_conversations() -> None:
    wl = build_workload("chat", "full", seed=0)
    sessions = [s.session for s in wl.steps]
    assert sessions != sorted(sessions)
    switches = sum(a != b for a, b in itertools.pairwise(sessions))
    assert switches > len(sessions) // 2
    assert wl.ram_cache_tokens is not None, "the full chat workload is sized to evict"


def test_restart_serves_every_conversation_before_and_after() -> None:
    wl = build_workload("restart", "quick", seed=0)
    assert wl.restart_at is not None
    before, after = wl.steps[: wl.restart_at], wl.steps[wl.restart_at :]
    assert {s.session for s in before} == {s.session for s in after}
    assert max(s.turn for s in before) < min(s.turn for s in after)
    assert list(wl.measured_steps) == list(range(wl.restart_at, len(wl.steps)))


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("chats")
    with pytest.raises(ValueError, match="unknown size"):
        build_workload("chat", "huge")


# -- the ideal cache ----------------------------------------------------------


def test_ideal_on_hand_made_cases() -> None:
    sys_ = [1, 2, 3, 4]
    requests = [
        ([*sys_, 10, 11], [20, 21, 22]),  # nothing before: 0
        ([*sys_, 10, 11, 20, 21, 22, 30], [40]),  # reuses prompt + answer minus its last: 8
        ([*sys_, 12], [41, 42]),  # shares the system prompt only: 4
        ([*sys_, 10, 11, 20, 21, 22, 30], [43]),  # repeats request 2: all but the last: 9
        (sys_[:2], [5]),  # a prefix of an earlier prompt: capped at len - 1 = 1
        ([7], [8]),  # one token: nothing reusable
        ([7, 8, 9], [1]),  # [7] was computed, [7, 8] was not (8 was its last token): 1
        ([*sys_, 12, 41, 42, 50], [2]),  # request 3 + its answer minus 42: 6
    ]
    want = [0, 8, 4, 9, 1, 0, 1, 6]
    assert trie_ideal(requests) == want
    assert brute_force_ideal(requests) == want


def test_ideal_picks_the_longest_of_several_branches() -> None:
    trie = PrefixTrie()
    for seq in ([1, 2, 3], [1, 2, 4, 5, 6], [1, 7]):
        trie.insert(seq)
    assert trie.match([1, 2, 4, 5, 9]) == 4
    assert trie.match([1, 2, 3, 4]) == 3
    assert trie.match([2]) == 0
    assert trie.match([]) == 0


def _random_requests(rng: random.Random, n: int) -> list[tuple[list[int], list[int]]]:
    """Chat-like: prompts that extend earlier prompts and answers, or branch off them."""
    out: list[tuple[list[int], list[int]]] = []
    for _ in range(n):
        if out and rng.random() < 0.8:
            p, g = rng.choice(out)
            base = (p + g)[: rng.randint(0, len(p) + len(g))]
        else:
            base = []
        prompt = base + [rng.randrange(6) for _ in range(rng.randint(1, 8))]
        out.append((prompt, [rng.randrange(6) for _ in range(rng.randint(1, 5))]))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_ideal_equals_brute_force_on_generated_requests(seed: int) -> None:
    requests = _random_requests(random.Random(seed), 60)
    got = trie_ideal(requests)
    assert got == brute_force_ideal(requests)
    assert sum(got) > 0


tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(tokens, tokens), max_size=15))
def test_ideal_equals_brute_force_on_any_requests(
    requests: list[tuple[list[int], list[int]]],
) -> None:
    assert trie_ideal(requests) == brute_force_ideal(requests)


def test_ideal_on_a_simulated_chat_workload() -> None:
    """Chat turns as a template would lay them out: each prompt carries the previous
    answer re-tokenized, sometimes differently from the generated ids."""
    rng = random.Random(5)
    header = [100, 101, 102]
    histories: dict[int, list[int]] = {}
    requests = []
    for step in build_workload("chat", "quick", seed=1).steps:
        history = histories.setdefault(step.session, list(header))
        history += [200] + [rng.randrange(50) for _ in range(rng.randint(5, 15))] + [201]
        generated = [rng.randrange(50) for _ in range(rng.randint(1, 6))] + [99]
        requests.append((list(history), generated))
        answer = generated[:-1] if rng.random() < 0.7 else [*generated[:-2], 7, 7]
        history += [202, *answer, 203]
    got = trie_ideal(requests)
    assert got == brute_force_ideal(requests)
    assert sum(got) > sum(len(p) for p, _ in requests) // 2
