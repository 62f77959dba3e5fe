"""Sampling parameters and the sampler."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

# The seeds torch.Generator.manual_seed accepts (a signed or an unsigned 64-bit int).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's limit

if TYPE_CHECKING:
    from pagedkv.engine.grammar import ResponseFormat, TokenConstraint


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0, top_p 1 and min_p 0 are off.
    `n` samples share the prompt's KV and decode side by side; sample i draws from
    `(seed + i) mod 2**64` when a seed is given. A seed is any int torch's generator
    takes, -2**63 to 2**64 - 1; torch reads a negative one modulo 2**64 as well, so
    the modulo gives every seed the stream it had before, and sample i of a seed
    near 2**64 - 1 wraps to a small seed instead of overflowing the generator.

    Penalties change the logits before the choice, greedy included:
    `repetition_penalty` (1 is off; Hugging Face / vLLM semantics) divides a positive
    logit and multiplies a negative one of every token in the prompt or generated so
    far; `presence_penalty` and `frequency_penalty` (0 is off; OpenAI semantics)
    subtract `presence * (count > 0) + frequency * count` over the generated tokens;
    `logit_bias` adds its value to its token's logit. `logprobs` reports the sampled
    token's log-probability, and `top_logprobs` the k most likely tokens', both under
    the model's own distribution (its raw logits, before any of the above).
    `response_format` constrains the output to a grammar (`engine.grammar`); the
    engine compiles it when the request is submitted."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    logprobs: bool = False
    top_logprobs: int = 0
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
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not 0.0 < float(self.repetition_penalty) <= 100.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0 or not -100.0 <= float(bias) <= 100.0:
                raise ValueError(
                    f"logit_bias maps token ids >= 0 to values in [-100, 100], got "
                    f"{token!r}: {bias!r}"
                )
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be an int from 0 to {MAX_TOP_LOGPROBS}, "
                f"got {self.top_logprobs!r}"
            )
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    @property
    def counts_tokens(self) -> bool:
        """Whether sampling depends on the tokens seen so far (a penalty is on)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(slots=True)
class Sampled:
    """One chosen token; `logprob` and `top` (the most likely (token id, logprob)
    pairs, most likely first) are under the model's raw distribution, and only
    filled when the request asked (0.0 and None otherwise)."""

    token: int
    logprob: float = 0.0
    top: list[tuple[int, float]] | None = None


class Sampler:
    """Picks the next token of one sequence from float32 logits; one generator each.

    With a penalty on, it keeps two vocabulary-sized tensors, built from the prompt on
    the first call and updated by one indexed write per chosen token: `seen` (in the
    prompt or generated) for `repetition_penalty` and `counts` (times generated) for
    the OpenAI penalties. They depend on token ids only, so a prompt restored from the
    cache samples exactly as a recomputed one, and a preempted sequence, which keeps
    its sampler, resumes with its counts. Order, as Hugging Face applies them:
    logit_bias, penalties, then (unless greedy) temperature, top_k, top_p, min_p.
    With a `constraint`, only tokens its grammar allows are picked (the mask goes on
    after the penalties, before the temperature; greedy masks only when the grammar
    forbids the top token), and each picked token advances it.
    """

    def __init__(
        self,
        params: SamplingParams,
        index: int = 0,
        prompt: Sequence[int] = (),
        constraint: TokenConstraint | None = None,
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
        self._prompt = list(prompt) if params.counts_tokens else []
        self._seen: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def sample(self, logits: torch.Tensor) -> Sampled:
        logits = logits.float()
        p = self.params
        scores = self.adjusted(logits)
        c = self.constraint
        # Temperatures this small only overflow the division; they mean greedy.
        if p.temperature < 1e-5:
            token = int(torch.argmax(scores))
            if c is not None and not c.allows(token):  # the mask only when it matters
                token = int(torch.argmax(c.apply(scores)))
        else:
            allowed = scores if c is None else c.apply(scores)
            probs = torch.softmax(self.truncated(allowed), dim=-1)
            token = int(torch.multinomial(probs.cpu(), 1, generator=self.generator))
        if c is not None:
            c.accept(token)
        if self._counts is not None and self._seen is not None:
            self._counts[token] += 1
            self._seen[token] = True
        out = Sampled(token)
        if p.logprobs or p.top_logprobs:
            logprobs = torch.log_softmax(logits, dim=-1)
            out.logprob = float(logprobs[token])
            if p.top_logprobs:
                top = torch.topk(logprobs, min(p.top_logprobs, logprobs.numel()))
                out.top = list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        return out

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with logit_bias and the penalties applied (no copy when all are off)."""
        p = self.params
        scores = logits
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            if int(ids.max()) >= logits.numel():
                raise ValueError(
                    f"logit_bias names token {int(ids.max())}, outside the model's "
                    f"{logits.numel()} logits"
                )
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            scores = scores.index_add(0, ids, bias.to(logits.device))
        if not p.counts_tokens:
            return scores
        seen, counts = self._history(logits)
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
        if p.presence_penalty or p.frequency_penalty:
            used = counts.to(scores.dtype)
            scores = scores - p.frequency_penalty * used - p.presence_penalty * (counts > 0)
        return scores

    def truncated(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` over the temperature, with the tokens top_k, top_p and min_p drop at
        -inf: the softmax of this is the distribution sampled from."""
        p = self.params
        scaled = scores / p.temperature
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
        if p.min_p > 0.0:
            probs = torch.softmax(scaled, dim=-1)
            scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        return scaled

    def _history(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._seen is None or self._counts is None:
            size = logits.numel()
            self._seen = torch.zeros(size, dtype=torch.bool, device=logits.device)
            self._counts = torch.zeros(size, dtype=torch.int32, device=logits.device)
            if self._prompt:
                ids = torch.tensor(self._prompt, dtype=torch.long, device=logits.device)
                self._seen[ids[ids < size]] = True
            self._prompt = []
        return self._seen, self._counts
