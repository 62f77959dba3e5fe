"""The incremental detokenizer emits exactly what re-decoding the whole answer on every
token emitted (kept here as the reference), and decodes O(answer) tokens, not O(answer^2)."""

from __future__ import annotations

import functools
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
