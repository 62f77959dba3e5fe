"""The incremental detokenizer emits exactly what re-decoding the whole answer on every
token emitted (kept here as the reference), and decodes O(answer) tokens, not O(answer^2),
on any tokens: invalid UTF-8 bytes and tokens that decode to nothing included."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

from fixtures_models import SPECIAL_TOKENS, make_tiny_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.engine.detokenize import Detokenizer
from pagedkv.engine.sampling import SamplingParams

EOS = 7_000_000  # never produced by the strategies below unless asked


class ReferenceDetokenizer:
    """The previous implementation: decode every token so far on each push."""

    def __init__(self, adapter: Any, params: SamplingParams, ignore: set[int]) -> None:
        self.adapter = adapter
        self.stop = [s for s in params.stop if s]
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else ignore)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0

    def push(self, token: int) -> tuple[str, str | None]:
        if token in self.stop_ids:
            return "", "stop"
        self.ids.append(token)
        text = self.adapter.decode(self.ids)
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.text = text[:at]
                return self._emit(len(self.text)), "stop"
        self.text = text
        end = len(text) - self.hold
        if text.endswith("\ufffd"):
            end = min(end, len(text) - 1)
        return self._emit(end), None

    def _emit(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def flush(self) -> str:
        return self._emit(len(self.text))


class CountingDecoder:
    """A tokenizer as the adapter wraps it (special tokens skipped), counting the work."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.calls = 0
        self.tokens_decoded = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.calls += 1
        self.tokens_decoded += len(ids)
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


@functools.cache
def byte_level() -> Any:
    return make_tiny_tokenizer(add_bos=True)


@functools.cache
def metaspace() -> Any:
    """A SentencePiece-style tokenizer (Metaspace: a leading space is dropped on decode)."""
    from fixtures_models import _CORPUS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    bytes_alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=[*SPECIAL_TOKENS, *bytes_alphabet], show_progress=False
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[1])


def run(cls: type, decoder: Any, tokens: list[int], params: SamplingParams) -> list[Any]:
    detok = cls(decoder, params, ignore={EOS})
    out: list[Any] = []
    for t in tokens:
        delta, finish = detok.push(t)
        out.append((delta, finish))
        if finish is not None:
            return out
    out.append(detok.flush())
    return out


def token_streams(tokenizer: Any) -> st.SearchStrategy[list[int]]:
    """Ids of real text (multi-byte characters split across tokens included), random
    ids (special tokens, lone bytes of a character) and both mixed."""
    vocab = len(tokenizer)
    pieces = [*"ab cd.,!?\n'", "é", "日本", "\U0001f600", " n't", " ."]
    text = st.lists(st.sampled_from(pieces), max_size=40).map(
        lambda p: list(tokenizer.encode("".join(p), add_special_tokens=False))
    )
    noise = st.lists(st.integers(0, vocab - 1), max_size=40)
    return st.lists(st.one_of(text, noise), min_size=1, max_size=4).map(
        lambda parts: [t for p in parts for t in p]
    )


def check_same(tokenizer: Any, tokens: list[int], stop: list[str]) -> None:
    params = SamplingParams(max_tokens=10_000, stop=tuple(stop))
    new = run(Detokenizer, CountingDecoder(tokenizer), tokens, params)
    old = run(ReferenceDetokenizer, CountingDecoder(tokenizer), tokens, params)
    assert new == old
    if not stop:
        text = "".join(d if isinstance(d, str) else d[0] for d in new)
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)


SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=st.data())
def test_byte_level_output_equals_the_full_decode(data: st.DataObject) -> None:
    tokens = data.draw(token_streams(byte_level()))
    stop = data.draw(st.lists(st.sampled_from(["a", "cd", ".\n", "日", "xyz"]), max_size=2))
    check_same(byte_level(), tokens, stop)


@SETTINGS
@given(data=st.data())
def test_sentencepiece_style_output_equals_the_full_decode(data: st.DataObject) -> None:
    tokens = data.draw(token_streams(metaspace()))
    stop = data.draw(st.lists(st.sampled_from(["a", " c", "!", "😀"]), max_size=2))
    check_same(metaspace(), tokens, stop)


def test_a_character_split_across_tokens_is_emitted_once_whole() -> None:
    from tokenizers import pre_tokenizers

    tok = byte_level()
    # one token per byte of U+1F600 (the byte-level alphabet's characters for them)
    ((chars, _),) = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str("😀")
    raw = [tok.convert_tokens_to_ids(c) for c in chars]
    assert len(raw) == 4
    decoder = CountingDecoder(tok)
    detok = Detokenizer(decoder, SamplingParams(), ignore=set())
    deltas = [detok.push(t)[0] for t in raw] + [detok.flush()]
    assert deltas[:3] == ["", "", ""] and deltas[3] == "😀"
    assert detok.text == "😀"


def test_special_tokens_are_skipped_as_in_the_full_decode() -> None:
    tok = metaspace()
    special = tok.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    words = tok.encode("hello there", add_special_tokens=False)
    tokens = [words[0], special, special, *words[1:]]
    check_same(tok, tokens, [])


def test_decoding_work_grows_linearly_with_the_answer() -> None:
    tok = byte_level()
    tokens = tok.encode(
        " the quick brown fox jumps over the lazy dog." * 60, add_special_tokens=False
    )
    n = len(tokens)
    assert n > 400
    new, old = CountingDecoder(tok), CountingDecoder(tok)
    params = SamplingParams(max_tokens=10_000)
    assert run(Detokenizer, new, tokens, params) == run(ReferenceDetokenizer, old, tokens, params)
    assert old.tokens_decoded >= n * (n + 1) // 2  # the whole answer, every token
    assert new.tokens_decoded <= 4 * n  # a window of a few tokens, every token
    assert new.calls <= 2 * n


@functools.cache
def byte_token_ids() -> list[int]:
    """The byte-level tokenizer's token for each byte value (its alphabet: any bytes at all)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 characters
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    assert sorted(chars.values()) == alphabet
    tok = byte_level()
    ids = [tok.convert_tokens_to_ids(chars[b]) for b in range(256)]
    assert tok.decode(ids[0xE6:0xE7] + ids[0x97:0x98] + ids[0xA5:0xA6]) == "日"
    return ids


# Bytes that make every kind of UTF-8 damage: stray continuations, lead bytes cut short
# (of 2, 3 and 4 byte characters), bytes that never occur (C0, F5-FF), surrogates (ED A0).
NASTY = [0x80, 0xBF, 0xC3, 0xA9, 0xE6, 0x97, 0xA5, 0xF0, 0x9F, 0x98, 0x80, 0xED, 0xA0, 0xC0,
         0xF5, 0xFF, 0x41, 0x20]  # fmt: skip


def byte_streams(tokenizer: Any) -> st.SearchStrategy[list[int]]:
    """Runs of single-byte tokens of arbitrary (mostly invalid) UTF-8, mixed with the
    ids of real text, special tokens and random ids."""
    ids = byte_token_ids()
    raw = st.lists(st.sampled_from(NASTY) | st.integers(0, 255), max_size=60).map(
        lambda bs: [ids[b] for b in bs]
    )
    special = st.lists(st.sampled_from([0, 1]), max_size=80)  # SPECIAL_TOKENS: skipped
    parts = st.lists(st.one_of(raw, token_streams(tokenizer), special), min_size=1, max_size=6)
    return parts.map(lambda found: [t for p in found for t in p])


@SETTINGS
@given(data=st.data())
def test_any_bytes_give_the_full_decode_with_a_byte_level_tokenizer(data: st.DataObject) -> None:
    """Byte-level BPE decodes as UTF-8 with each maximal invalid subpart replaced by one
    U+FFFD, whatever the bytes: the deltas add up to that, however long the damage."""
    tokens = data.draw(byte_streams(byte_level()))
    stop = data.draw(st.lists(st.sampled_from(["a", "\ufffd\ufffd", "日", "A "]), max_size=2))
    check_same(byte_level(), tokens, stop)


@SETTINGS
@given(data=st.data())
def test_valid_utf8_in_byte_fallback_tokens_gives_the_full_decode(data: st.DataObject) -> None:
    """SentencePiece byte fallback: characters outside the vocabulary come as one
    `<0xNN>` token per byte, split anywhere between text and special tokens."""
    tok = metaspace()
    byte_ids = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    chars = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=8)
    as_bytes = chars.map(lambda text: [byte_ids[b] for b in text.encode()])
    special = st.lists(st.sampled_from([0, 1]), max_size=12)
    parts = st.lists(st.one_of(as_bytes, special, token_streams(tok)), min_size=1, max_size=8)
    tokens = [t for p in data.draw(parts) for t in p]
    check_same(tok, tokens, data.draw(st.lists(st.sampled_from(["a", "!", "😀"]), max_size=1)))


class ByteDecoder:
    """Byte-level decoding without a tokenizer, as fast as Python allows: ids below 256
    are that byte, 256 decodes to nothing (a skipped special token), 257 to a word.
    Counts the tokens it is asked to decode, and fails once past `budget`."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self.tokens_decoded = 0

    def decode(self, ids: Sequence[int]) -> str:
        self.tokens_decoded += len(ids)
        if self.budget is not None and self.tokens_decoded > self.budget:
            raise AssertionError(f"decoded {self.tokens_decoded} tokens, over {self.budget}")
        parts = [bytes([i]) if i < 256 else b"" if i == 256 else WORD for i in ids]
        return b"".join(parts).decode("utf-8", "replace")


WORD = b" linear" * 64


def invalid_run(n: int) -> list[int]:
    """`n` tokens of bytes that never finish a character (cut-short leads, stray
    continuations, bytes that never occur, tokens of no text between them): the text
    ends in U+FFFD after every one of them."""
    cycle = [0xF0, 0x9F, 0x98, 0xF0, 0x80, 0xE6, 0x97, 0xC3, 0xFF, 256, 256, 0x80]
    return [cycle[i % len(cycle)] for i in range(n)]


def test_a_long_run_of_invalid_bytes_is_decoded_in_linear_work() -> None:
    n = 100_000
    tokens = invalid_run(n)
    decoder = ByteDecoder(budget=40 * n)  # a push decodes a bounded window
    detok = Detokenizer(decoder, SamplingParams(max_tokens=n), ignore=set())
    deltas = [detok.push(t)[0] for t in tokens]
    deltas.append(detok.flush())
    expected = ByteDecoder().decode(tokens)
    assert "".join(deltas) == expected == detok.text
    assert expected.count("\ufffd") > n // 2


def test_invalid_bytes_through_the_real_tokenizer_cost_a_bounded_window() -> None:
    ids = byte_token_ids()
    tokens = [ids[b] if b < 256 else 0 for b in invalid_run(6000)]
    decoder = CountingDecoder(byte_level())
    out = run(Detokenizer, decoder, tokens, SamplingParams(max_tokens=10_000))
    assert "".join(d if isinstance(d, str) else d[0] for d in out) == byte_level().decode(
        tokens, skip_special_tokens=True
    )
    assert decoder.tokens_decoded <= 40 * len(tokens)
    assert decoder.calls <= 3 * len(tokens)


def _seconds(tokens: list[int], stop: tuple[str, ...]) -> float:
    best = float("inf")
    for _ in range(3):
        detok = Detokenizer(ByteDecoder(), SamplingParams(max_tokens=10**6, stop=stop), set())
        start = time.perf_counter()
        for t in tokens:
            detok.push(t)
        detok.flush()
        best = min(best, time.perf_counter() - start)
    return best


def test_the_text_is_not_copied_on_every_token() -> None:
    """Tokens of long text: a copy of the whole text per token would make 5x the
    tokens cost 25x the time; linear work costs 5x."""
    small = [257] * 2000
    ratio = _seconds(small * 5, ("zz",)) / _seconds(small, ("zz",))
    assert ratio < 12, f"5x the tokens took {ratio:.1f}x the time"
