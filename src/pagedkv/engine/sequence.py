"""One stream of tokens the scheduler runs: a request, or one of its `n` samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedkv.cache.prefix import RequestCache
from pagedkv.engine.detokenize import Detokenizer
from pagedkv.engine.request import GenerationResult, Request
from pagedkv.engine.sampling import Sampler
from pagedkv.model.backend import SeqKV


@dataclass(eq=False)
class Sequence:
    """`tokens` is the prompt, then every sampled token. The first `num_computed`
    have their KV in `kv` (`[L, 2, H, capacity, D]`, batched models) or in `cache`
    (a transformers cache, models run one sequence per forward). The sequence
    computes `tokens[num_computed:]` (a prefill, or the one token sampled last)
    and samples when it reaches the end of `tokens`.

    `order` is when the scheduler first admitted it (the newest is preempted
    first); `capacity` tokens of KV, and `state_tokens` for a snapshot, are
    reserved for it in the engine's budget while it runs. A preempted sequence
    keeps its tokens, sampler and detokenizer, and resumes from whatever its KV
    left in the prefix cache.
    """

    request: Request
    index: int
    tokens: list[int]
    num_prompt_tokens: int
    max_tokens: int
    sampler: Sampler
    decoder: Detokenizer
    order: int = 0
    kv: SeqKV | None = None
    capacity: int = 0
    num_computed: int = 0
    handle: RequestCache | None = None
    # A request's first sample forks the other n - 1 after its prefill; the KV (and
    # snapshot room) for them is reserved with its own at admission.
    samples_to_fork: int = 0
    sibling_capacity: int = 0
    cached_tokens: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    # Recurrent-state snapshots (models with state layers) the sequence still holds, by
    # the token count they follow: at most the newest one past its hash chain (the
    # others go to the snapshot store when taken). `state_tokens` of the KV budget are
    # reserved for it while the sequence runs.
    snapshots: dict[int, torch.Tensor] = field(default_factory=dict)
    state_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    ttft: float = 0.0
    finish_reason: str | None = None
    prompt_cached: bool = False
    stored_tokens: int = 0  # prefill-only: prompt tokens the cache held at its end
    # A prefill of this prompt's prefix to wait for before admission (`Scheduler.add`).
    wait_for: Request | None = None
    admitted: bool = False  # has been admitted once (cached_tokens, ttft are final)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    @property
    def num_pending(self) -> int:
        """Tokens to compute before the next sample."""
        return len(self.tokens) - self.num_computed

    @property
    def final_capacity(self) -> int:
        """The most KV the sequence can ever need: its prompt and every answer token."""
        return self.num_prompt_tokens + self.max_tokens

    def result(self) -> GenerationResult:
        req = self.request
        return GenerationResult(
            text=self.decoder.text,
            token_ids=list(self.generated),
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.cached_tokens,
            ttft_s=self.ttft,
            finish_reason=self.finish_reason or "cancelled",
            total_s=time.perf_counter() - req.submitted,
            logprobs=list(self.logprobs) if req.params.logprobs else None,
            top_logprobs=list(self.top_logprobs) if req.params.top_logprobs else None,
            tier_hits=dict(self.tier_hits),
            index=self.index,
            stored_tokens=self.stored_tokens,
            leased_tokens=req.leased_tokens,
        )


def unborn_result(req: Request, index: int) -> GenerationResult:
    """The result of sample `index`, cancelled before it was forked."""
    return GenerationResult(
        text="",
        token_ids=[],
        prompt_tokens=len(req.prompt),
        cached_tokens=0,
        ttft_s=0.0,
        finish_reason="cancelled",
        total_s=time.perf_counter() - req.submitted,
        logprobs=[] if req.params.logprobs else None,
        top_logprobs=[] if req.params.top_logprobs else None,
        index=index,
    )
