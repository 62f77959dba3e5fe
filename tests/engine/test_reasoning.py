"""Prewarm (prefill-only requests) and reasoning-aware storing, on the engine.

The tiny model's template strips earlier turns' reasoning the way Qwen3's does
(`REASONING_CHAT_TEMPLATE`); the plain ChatML one keeps it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv import CacheConfig, Engine, SamplingParams

BS = 8
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _engine(model: Path, mode: str = "auto", caching: bool = True) -> Engine:
    config = CacheConfig(block_size=BS, reasoning_cache=mode, enable_prefix_caching=caching)
    return Engine.from_pretrained(str(model), config=config)


def _turns(eng: Engine) -> tuple[list[int], list[int], int, int]:
    """Turn 1, then turn 2 after a new user message: turn 2's prompt, its answer, how
    many of its tokens precede the new user message's content, and its cached tokens."""
    history = [{"role": "user", "content": "Plan the release of the cache."}]
    first = eng.apply_chat_template(history)
    r = eng.generate(first, GREEDY)
    history.append({"role": "assistant", "content": r.text})
    eng.store_next_turn(history, first + r.token_ids)  # None when the policy is off
    history.append({"role": "user", "content": "Now the second step, please."})
    second = eng.apply_chat_template(history)
    probe = eng.apply_chat_template([*history[:-1], {"role": "user", "content": "x"}])
    upto = next(i for i, (a, b) in enumerate(zip(second, probe, strict=False)) if a != b)
    out = eng.generate(second, GREEDY)
    return second, out.token_ids, upto, out.cached_tokens


def test_the_render_test_finds_which_template_strips(
    tiny_reasoning_dir: Path, tiny_qwen2_dir: Path
) -> None:
    with _engine(tiny_reasoning_dir) as eng:
        assert eng.reasoning.strips is True and eng.reasoning.active
    with _engine(tiny_qwen2_dir) as eng:  # plain ChatML keeps every turn as it was
        assert eng.reasoning.strips is False and not eng.reasoning.active
        history = [{"role": "user", "content": "hello"}]
        ids = eng.apply_chat_template(history)
        r = eng.generate(ids, GREEDY)
        assert (
            eng.store_next_turn(
                [*history, {"role": "assistant", "content": r.text}], ids + r.token_ids
            )
            is None
        )
    with _engine(tiny_reasoning_dir, mode="off") as eng:
        assert eng.reasoning.strips is True and not eng.reasoning.active
    with _engine(tiny_qwen2_dir, mode="on") as eng:
        assert eng.reasoning.active


def test_next_turn_hits_up_to_its_new_message_and_answers_as_fresh(
    tiny_reasoning_dir: Path,
) -> None:
    with _engine(tiny_reasoning_dir, mode="off") as eng:
        prompt_off, answer_off, upto, cached_off = _turns(eng)
        assert cached_off < upto - BS  # today: the stripped turn misses
    with _engine(tiny_reasoning_dir) as eng:
        prompt_on, answer_on, upto_on, cached_on = _turns(eng)
    assert prompt_on == prompt_off and upto_on == upto
    # The background prefill ran before turn 2 (it was queued first): a hit up to turn
    # 2's new user message (its role header included).
    assert cached_on >= upto - 1
    assert answer_on == answer_off  # cached == fresh, greedy
    with _engine(tiny_reasoning_dir, caching=False) as cold:
        assert cold.generate(prompt_off, GREEDY).token_ids == answer_off


def test_explain_names_the_stripped_reasoning(tiny_reasoning_dir: Path) -> None:
    with _engine(tiny_reasoning_dir, mode="off") as eng:
        history = [{"role": "user", "content": "Plan the release of the cache."}]
        first = eng.apply_chat_template(history)
        r = eng.generate(first, GREEDY)
        history += [
            {"role": "assistant", "content": r.text},
            {"role": "user", "content": "Next."},
        ]
        second = eng.apply_chat_template(history)
        exp = eng.explain(second)
        assert exp.miss is not None and exp.miss.reason == "reasoning_stripped"
        shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        assert exp.miss.token_index == exp.cached_tokens == shared  # where <think> began
        assert eng.decode(first[shared:]).startswith("<think>")
        # A prompt that diverges elsewhere is only 'diverged'.
        other = eng.explain(first[:20] + eng.encode_continuation(" something else entirely"))
        assert other.miss is not None and other.miss.reason == "diverged"


def test_a_tool_turn_keeps_its_reasoning_a_user_turn_drops_it(tiny_reasoning_dir: Path) -> None:
    """After a tool call the next prompt's form keeps the whole turn (its prompt, think
    header included); after an answer it drops the think header the prompt ended with."""
    with _engine(tiny_reasoning_dir) as eng:
        history = [{"role": "user", "content": "Find the file."}]
        ids = eng.apply_chat_template(history)
        r = eng.generate(ids, GREEDY)
        history.append({"role": "assistant", "content": r.text})
        tool = eng.store_next_turn(history, ids + r.token_ids, follow="tool")
        user = eng.store_next_turn(history, ids + r.token_ids, follow="user")
        assert tool is not None and tool.shared_tokens >= len(ids)
        assert user is not None and user.submitted and user.shared_tokens < len(ids)


def test_prewarm_stores_the_prompt_and_a_request_then_hits(tiny_reasoning_dir: Path) -> None:
    with _engine(tiny_reasoning_dir) as eng:
        ids = eng.apply_chat_template(
            [{"role": "user", "content": "A long shared system part " * 4}]
        )
        warm = eng.prewarm(ids)
        assert warm.token_ids == [] and warm.finish_reason == "stored"
        assert warm.cached_tokens == 0 and warm.stored_tokens == len(ids)
        again = eng.prewarm(ids)
        assert again.cached_tokens == len(ids) - 1
        r = eng.generate(ids + ids[:3], GREEDY)
        assert r.cached_tokens >= len(ids)
        stats = eng.cache_stats()
        assert stats.scheduling.running == 0 and stats.scheduling.kv_reserved_bytes == 0


@pytest.mark.parametrize("mode", ["sometimes"])
def test_a_bad_mode_is_refused(mode: str) -> None:
    with pytest.raises(ValueError, match="reasoning_cache"):
        CacheConfig(reasoning_cache=mode)
