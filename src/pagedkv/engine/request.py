"""What a caller gets back from the engine."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class GenerationResult:
    """A finished request.

    `cached_tokens` counts the prompt tokens whose KV came from the cache (any
    tier); `ttft_s` runs from submission to the first generated token.
    `finish_reason` is "stop" (eos, stop string or stop token), "length"
    (max_tokens) or "cancelled".
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    finish_reason: str
    total_s: float = 0.0
    logprobs: list[float] | None = None
    tier_hits: dict[str, int] = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StreamEvent:
    """One step of a stream: new token ids and the text they complete.

    The last event has `finished=True` and carries the `result`; its
    `token_ids`/`text` may be empty.
    """

    token_ids: list[int]
    text: str
    finished: bool = False
    result: GenerationResult | None = None
    logprobs: list[float] | None = None
