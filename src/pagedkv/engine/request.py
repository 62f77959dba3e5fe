"""A request as the engine holds it, and what a caller gets back."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from pagedkv.cache.hashing import ExtraKeys
from pagedkv.cache.leases import LeaseRequest
from pagedkv.engine.grammar import CompiledGrammar
from pagedkv.engine.sampling import SamplingParams
from pagedkv.model.lora import LoraWeights
from pagedkv.model.mrope import MRopePositions
from pagedkv.model.vision import ImageSpan


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
    # Per generated token, its `top_logprobs` most likely (token id, logprob) pairs.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    tier_hits: dict[str, int] = field(default_factory=dict)
    index: int = 0  # which of the request's `n` samples
    # A prefill-only request (`Engine.prewarm`): prompt tokens whose KV the cache holds
    # once it ended (its blocks that RAM took); 0 for a generating request.
    stored_tokens: int = 0
    # Prompt tokens a lease the request asked for covers now (`Request.leases`).
    leased_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StreamEvent:
    """One step of a stream: new token ids of sample `index` and the text they complete.

    A sample's last event has `finished=True` and carries its `result`; its
    `token_ids`/`text` may be empty. A request with `n` samples ends after `n`
    finished events.
    """

    token_ids: list[int]
    text: str
    finished: bool = False
    result: GenerationResult | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    index: int = 0


@dataclass
class Request:
    """A submitted request: prompt ids, sampling, cache extras, who sent it (`owner`,
    for fair admission; None: no one in particular), and the queue the worker puts
    its events on. `cancelled` may be set from any thread. `grammar` is
    `params.response_format` compiled; each sample's sampler gets its own copy.

    `prefill_only`: compute and cache the prompt's KV, sample nothing (`Engine.prewarm`);
    its one result has no tokens and finish_reason "stored". `background`: waits behind
    every other request and prefills after them (the scheduler's low priority), for work
    the server starts on its own (`engine.reasoning`)."""

    prompt: list[int]
    params: SamplingParams
    extra: ExtraKeys | None
    owner: str | None = None
    grammar: CompiledGrammar | None = None
    prefill_only: bool = False
    background: bool = False
    lora: LoraWeights | None = None  # the LoRA adapter it runs with, held to its end
    leases: tuple[LeaseRequest, ...] = ()  # granted once the prompt is cached
    leased_tokens: int = 0  # what the grants covered (the longest)
    # The prompt's images (`model.vision`): their spans are segments of `extra`, and
    # prompt chunks over their placeholder tokens read their encoder rows.
    images: tuple[ImageSpan, ...] = ()
    # Their M-RoPE positions (`model.mrope`), made once from them: every chunk of every
    # sample, decode steps included, reads its positions here. None: 1-D positions.
    positions: MRopePositions | None = None
    events: queue.Queue[StreamEvent | BaseException] = field(default_factory=queue.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # The worker's bookkeeping: samples still running, results so far, an error sent.
    num_open: int = 0
    results: list[GenerationResult] = field(default_factory=list)
    failed: bool = False


class RequestStream(Iterator[StreamEvent]):
    """The events of one request, its samples interleaved. `cancel()` may be called
    from any thread (a server noticing a disconnect); `close()`, or dropping the
    stream, cancels too."""

    def __init__(self, req: Request) -> None:
        self._req = req
        self._left = req.params.n
        self._done = False

    def __next__(self) -> StreamEvent:
        if self._done:
            raise StopIteration
        event = self._req.events.get()
        if isinstance(event, BaseException):
            self._done = True
            raise event
        if event.finished:
            self._left -= 1
            self._done = self._left == 0
        return event

    def cancel(self) -> None:
        self._req.cancelled.set()

    def close(self) -> None:
        self._req.cancelled.set()
        self._done = True

    def __del__(self) -> None:
        self._req.cancelled.set()
