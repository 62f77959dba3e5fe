"""Incremental detokenization with stop strings, linear in the answer on any tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedkv.engine.sampling import SamplingParams

REPLACEMENT = "\ufffd"
# The window is cut once this many tokens wait uncommitted (see `Detokenizer`). A
# character of valid UTF-8 is at most 4 bytes, so at most 4 tokens that carry a byte
# each; the rest of the bound is slack for tokens that decode to nothing.
MAX_PENDING = 8
KEEP_PENDING = 4  # tokens left uncommitted by a cut: enough bytes to finish any character
# Past this, the window moves on whatever its text: only a decoder whose output for a
# token depends on unboundedly many tokens before it (a byte-fallback run that holds an
# invalid byte is replaced as a whole) gets here, and it gets approximate text, not
# quadratic time.
HARD_PENDING = 64


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class Detokenizer:
    """Turns tokens into text deltas, holding back what a stop string might still claim.

    Each push decodes only a window of the newest tokens, not the whole answer
    (which made a long answer quadratic): `_prefix` is where the window starts
    and `_read` where its already-committed part ends. The new text is the
    window's text minus the text of its committed part, so whatever a tokenizer
    does at the start of a decode (SentencePiece drops a leading space) cancels
    out. The window moves on when its text grew and does not end in an
    unfinished multi-byte character (U+FFFD), the rule vLLM and TGI use; until
    then it widens, and the bytes of a character split across tokens are
    decoded together.

    That rule alone widens the window forever on a run of invalid UTF-8 bytes
    (the text always ends in U+FFFD) or of tokens that decode to nothing, and
    each push then decodes the whole run: quadratic. So once `MAX_PENDING`
    tokens wait, the window is cut before its last `KEEP_PENDING` tokens when
    that split is clean: the text of the tokens before it is a strict prefix of
    the whole window's text, so the tokens after it changed none of it, and
    under UTF-8's replacement of maximal invalid subparts (what byte-level BPE
    decoders do) an unfinished character at the split is settled once any
    character follows it. Past `HARD_PENDING` the window moves on regardless.
    A push therefore decodes O(`HARD_PENDING`) tokens.

    `text` is what decoding every token at once gives, for tokenizers whose
    decoding of a sequence is the decoding of its parts (byte-level BPE on any
    bytes, SentencePiece with byte fallback on valid UTF-8). Only the text a
    stop string may still match (its length back from what was sent) and the
    uncommitted part are kept as strings that change; the rest is a list of
    pieces joined once, when `text` is read, never copied per token.

    What is emitted follows the same rules as decoding the whole answer each
    time: up to `hold` characters stay back for stop strings, a trailing U+FFFD
    stays back, a stop string ends the text just before it.
    """

    def __init__(self, adapter: Decoder, params: SamplingParams, ignore: set[int]) -> None:
        self.adapter = adapter
        self.stop = [s for s in params.stop if s]
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else ignore)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self._lookback = self.hold + 1 if self.stop else 0
        self.ids: list[int] = []
        self.sent = 0
        self._prefix = 0  # the window: ids[_prefix:]; ids[_prefix:_read] is committed
        self._read = 0
        self._done = ""  # the text of ids[_prefix:_read], decoded as a window of its own
        self._pieces: list[str] = []  # committed text before `_recent_at`
        self._recent_at = 0
        self._recent = ""  # committed text from `_recent_at` on
        self._live = ""  # the text of ids[_read:], as the window decodes it now
        self._stopped_at: int | None = None

    @property
    def text(self) -> str:
        """Everything decoded so far (up to a stop string, once one matched)."""
        full = "".join(self._pieces) + self._recent + self._live
        return full if self._stopped_at is None else full[: self._stopped_at]

    def push(self, token: int) -> tuple[str, str | None]:
        if token in self.stop_ids:
            return "", "stop"
        self.ids.append(token)
        self._decode_new()
        tail = self._recent + self._live  # text[_recent_at:]
        base = self._recent_at
        for s in self.stop:
            at = tail.find(s, max(0, self.sent - len(s) - base))
            if at != -1:
                self._stopped_at = base + at
                return self._emit(tail, base + at), "stop"
        end = base + len(tail) - self.hold
        if tail.endswith(REPLACEMENT):  # an unfinished multi-byte character
            end = min(end, base + len(tail) - 1)
        delta = self._emit(tail, end)
        self._forget()
        return delta, None

    def _decode_new(self) -> None:
        """Decode the window; commit what is final, keep the rest in `_live`."""
        window = self.adapter.decode(self.ids[self._prefix :])
        self._live = window[len(self._done) :]
        pending = len(self.ids) - self._read
        settled = len(window) > len(self._done) and not window.endswith(REPLACEMENT)
        if settled or pending > HARD_PENDING:
            self._commit(self._live, len(self.ids))
        elif pending > MAX_PENDING:
            cut = len(self.ids) - KEEP_PENDING
            head = self.adapter.decode(self.ids[self._prefix : cut])
            if len(self._done) <= len(head) < len(window) and window.startswith(head):
                live = window[len(head) :]
                self._commit(head[len(self._done) :], cut)
                self._live = live

    def _commit(self, text: str, upto: int) -> None:
        """ids[_read:upto] are final and their text is `text`; the window moves on."""
        self._recent += text
        self._live = ""
        self._prefix, self._read = self._read, upto
        self._done = self.adapter.decode(self.ids[self._prefix : self._read])

    def _forget(self) -> None:
        """Move committed text no stop string can reach any more out of `_recent`."""
        keep_from = min(self.sent - self._lookback, self._recent_at + len(self._recent))
        drop = keep_from - self._recent_at
        if drop > 0 and drop * 2 >= len(self._recent):  # amortised: each char moves once
            self._pieces.append(self._recent[:drop])
            self._recent = self._recent[drop:]
            self._recent_at = keep_from

    def _emit(self, tail: str, end: int) -> str:
        if end <= self.sent:
            return ""
        delta = tail[self.sent - self._recent_at : end - self._recent_at]
        self.sent = end
        return delta

    def flush(self) -> str:
        tail = self._recent + self._live
        end = self._recent_at + len(tail)
        return self._emit(tail, end if self._stopped_at is None else self._stopped_at)
