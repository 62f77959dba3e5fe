"""Sampling parameters and the sampler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

# The seeds torch.Generator.manual_seed accepts (a signed or an unsigned 64-bit int).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

if TYPE_CHECKING:
    from pagedkv.engine.grammar import ResponseFormat, TokenConstraint


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 and top_p 1 are off.
    `n` samples share the prompt's KV and decode side by side; sample i draws from
    `(seed + i) mod 2**64` when a seed is given. A seed is any int torch's generator
    takes, -2**63 to 2**64 - 1; torch reads a negative one modulo 2**64 as well, so
    the modulo gives every seed the stream it had before, and sample i of a seed
    near 2**64 - 1 wraps to a small seed instead of overflowing the generator.
    `response_format` constrains the output to a grammar (`engine.grammar`); the
    engine compiles it when the request is submitted."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    logprobs: bool = False
    ignore_eos: bool = False
    n: int = 1
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= 64:
            raise ValueError(f"n must be an int from 1 to 64, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ValueError(
                f"seed must be an int from {SEED_MIN} to {SEED_MAX}, got {self.seed!r}"
            )
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


class Sampler:
    """Picks the next token from float32 logits; one generator per request. With a
    `constraint`, only tokens its grammar allows are picked, and each picked token
    advances it."""

    def __init__(
        self, params: SamplingParams, index: int = 0, constraint: TokenConstraint | None = None
    ) -> None:
        self.params = params
        self.constraint = constraint
        self.generator: torch.Generator | None = None
        if params.temperature >= 1e-5:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed((params.seed + index) % 2**64)
            else:
                self.generator.seed()

    def sample(self, logits: torch.Tensor) -> tuple[int, float]:
        """Return (token id, its log-probability under the unmodified distribution)."""
        logits = logits.float()
        p = self.params
        c = self.constraint
        # Temperatures this small only overflow the division; they mean greedy.
        if p.temperature < 1e-5:
            token = int(torch.argmax(logits))
            if c is not None and not c.allows(token):  # the mask only when it matters
                token = int(torch.argmax(c.apply(logits)))
        else:
            scaled = (logits if c is None else c.apply(logits)) / p.temperature
            if p.top_k > 0 and p.top_k < scaled.numel():
                kth = torch.topk(scaled, p.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if p.top_p < 1.0:
                sorted_logits, order = torch.sort(scaled, descending=True)
                cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
                drop = cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p
                drop[0] = False  # the most likely token always stays, however small top_p
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
                scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
            probs = torch.softmax(scaled, dim=-1)
            token = int(torch.multinomial(probs.cpu(), 1, generator=self.generator))
        if c is not None:
            c.accept(token)
        logprob = float(torch.log_softmax(logits, dim=-1)[token]) if p.logprobs else 0.0
        return token, logprob
