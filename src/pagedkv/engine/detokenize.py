"""Incremental detokenization with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedkv.engine.sampling import SamplingParams


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class Detokenizer:
    """Turns tokens into text deltas, holding back what a stop string might still claim.

    Each push decodes only a window of the newest tokens, not the whole answer
    (which made a long answer quadratic): `_prefix` is where the window starts
    and `_read` where its already-committed part ends. The new text is the
    window's text minus the text of its committed part, so whatever a tokenizer
    does at the start of a decode (SentencePiece drops a leading space) cancels
    out. The window moves on only when its text grew and does not end in an
    unfinished multi-byte character (U+FFFD); until then it widens, and the
    bytes of a character split across tokens are decoded together. `text` is
    always what decoding every token at once gives, for tokenizers whose
    decoding of a sequence is the decoding of its parts (byte-level BPE,
    SentencePiece); the rule is the one vLLM and TGI use.

    What is emitted follows the same rules as decoding the whole answer each
    time: up to `hold` characters stay back for stop strings, a trailing U+FFFD
    stays back, a stop string ends the text just before it.
    """

    def __init__(self, adapter: Decoder, params: SamplingParams, ignore: set[int]) -> None:
        self.adapter = adapter
        self.stop = [s for s in params.stop if s]
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else ignore)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self._prefix = 0  # the window: ids[_prefix:]; ids[_prefix:_read] is committed
        self._read = 0
        self._committed = ""  # the text of ids[:_read]

    def push(self, token: int) -> tuple[str, str | None]:
        if token in self.stop_ids:
            return "", "stop"
        self.ids.append(token)
        text = self._decode_new()
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at != -1:
                self.text = text[:at]
                return self._emit(len(self.text)), "stop"
        self.text = text
        end = len(text) - self.hold
        if text.endswith("\ufffd"):  # an unfinished multi-byte character
            end = min(end, len(text) - 1)
        return self._emit(end), None

    def _decode_new(self) -> str:
        """The text of every token so far, decoding only the window."""
        done = self.adapter.decode(self.ids[self._prefix : self._read]) if self._read else ""
        window = self.adapter.decode(self.ids[self._prefix :])
        text = self._committed + window[len(done) :]
        if len(window) > len(done) and not window.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            self._committed = text
        return text

    def _emit(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta

    def flush(self) -> str:
        return self._emit(len(self.text))
