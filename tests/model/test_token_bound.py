"""The fewest tokens a text can make, known without tokenizing it: sound for the
tokenizers it trusts (every text makes at least that many), unknown for the others,
and a prompt past the context refused before the tokenizer runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fixtures_models import make_tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import Engine
from pagedkv.errors import PromptTooLongError
from pagedkv.model.token_bound import (
    NFC_SHRINK,
    _normalizer_shrink,
    _pre_keeps,
    fewest_tokens,
    max_chars_per_token,
)

# Text a tokenizer finds hard to bound: long runs of one character (merged into long
# tokens), whitespace runs, multi-byte characters, combining marks, special tokens.
PIECES = st.sampled_from(
    ["#", "=", " ", "\n", "    ", "the", "ž", "e\u0301", "\u1f00\u0345", "日本", "🙂", "<|im_end|>"]
)
TEXTS = st.lists(PIECES, max_size=300).map("".join)


@pytest.fixture(scope="module")
def bundled() -> Any:
    from transformers import AutoTokenizer

    from pagedkv.model.bundled import ensure_bundled_model

    return AutoTokenizer.from_pretrained(ensure_bundled_model())


@settings(max_examples=200, deadline=None)
@given(text=TEXTS)
def test_no_text_makes_fewer_tokens_than_the_bound(bundled: Any, text: str) -> None:
    for tokenizer in (bundled, TINY):
        per_token = bound_of(tokenizer)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) >= fewest_tokens(len(text), per_token)


TINY = make_tiny_tokenizer(add_bos=True)
_BOUNDS: dict[int, int] = {}


def bound_of(tokenizer: Any) -> int:
    """`max_chars_per_token`, worked out once per tokenizer (it reads the whole vocabulary)."""
    if id(tokenizer) not in _BOUNDS:
        per_token = max_chars_per_token(tokenizer)
        assert per_token is not None
        _BOUNDS[id(tokenizer)] = per_token
    return _BOUNDS[id(tokenizer)]


def test_the_bound_is_the_longest_token(bundled: Any) -> None:
    per_token = max_chars_per_token(bundled)
    assert per_token is not None
    longest = max(len(t) for t in bundled.get_vocab())
    assert per_token == longest  # byte-level BPE, no normalizer: nothing to multiply


def test_normalizers_and_pre_tokenizers_that_delete_give_no_bound() -> None:
    assert _normalizer_shrink(None) == 1
    assert _normalizer_shrink({"type": "NFC"}) == NFC_SHRINK
    keep = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}  # fmt: skip
    assert _normalizer_shrink(keep) == 1
    strip_after_nfc = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Strip"}]}
    deleting = [
        {"type": "StripAccents"},
        {"type": "Strip"},
        {"type": "Replace", "pattern": {"String": "ab"}, "content": ""},
        strip_after_nfc,
    ]
    for spec in deleting:
        assert _normalizer_shrink(spec) is None, spec
    assert _pre_keeps({"type": "ByteLevel"})
    assert _pre_keeps({"type": "Split", "behavior": "Isolated"})
    assert not _pre_keeps({"type": "Whitespace"})
    assert not _pre_keeps({"type": "Split", "behavior": "Removed"})


def test_a_prompt_past_the_context_is_refused_before_the_tokenizer_runs(
    tiny_llama_dir: Path,
) -> None:
    with Engine.from_pretrained(str(tiny_llama_dir)) as engine:
        adapter = engine.adapter
        per_token = adapter.max_token_chars
        assert per_token is not None
        calls = []
        real = adapter.tokenizer.encode

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return real(*args, **kwargs)

        adapter.tokenizer.encode = counting
        context = engine.max_context
        huge = "x" * (context * per_token + 1)
        with pytest.raises(PromptTooLongError, match="context"):
            engine.tokenize(huge, max_tokens=context)
        messages = [{"role": "user", "content": huge}]
        with pytest.raises(PromptTooLongError):
            engine.apply_chat_template(messages, max_tokens=context)
        assert not calls
        assert engine.tokenize("x" * 10, max_tokens=context)  # short texts are tokenized
        assert calls
        fits = engine.apply_chat_template([{"role": "user", "content": "hi"}])
        assert fits == engine.apply_chat_template(
            [{"role": "user", "content": "hi"}], max_tokens=context
        )
