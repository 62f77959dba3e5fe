"""The engine's figures, typed end to end: the server renders them, never re-parses them."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.cache.prefix import CacheStats


@dataclass(slots=True)
class RequestCounters:
    """Totals over finished requests since the engine started."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    cancelled: int = 0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The batch now: sequences running and waiting, the KV budget and what running
    sequences reserve of it, and totals since start."""

    running: int
    waiting: int
    kv_budget_bytes: int
    kv_reserved_bytes: int
    preemptions: int
    steps: int
    cache_errors: int  # cache-path failures that cost a recompute, never a request
    batched: bool  # False: the model runs one sequence per forward
    deterministic: bool


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot: the model, why caching is off when it is, the request totals and the
    prefix cache's own figures (None when caching is off)."""

    model: str
    prefix_caching: bool
    caching_off_reason: str | None
    requests: RequestCounters
    cache: CacheStats | None
    scheduling: SchedulerStats | None = None
