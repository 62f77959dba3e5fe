"""Incremental detokenization with stop strings."""

from __future__ import annotations

from pagedkv.engine.sampling import SamplingParams
from pagedkv.model import ModelAdapter


class Detokenizer:
    """Turns tokens into text deltas, holding back what a stop string might still claim."""

    def __init__(self, adapter: ModelAdapter, params: SamplingParams, ignore: set[int]) -> None:
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
        if text.endswith("\ufffd"):  # an unfinished multi-byte character
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
