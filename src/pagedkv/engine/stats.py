"""The engine's figures, typed end to end: the server renders them, never re-parses them."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.cache.prefix import CacheStats
from pagedkv.model.vision_cache import VisionCacheStats

__all__ = [
    "Accounting",
    "EngineStats",
    "RequestCounters",
    "RuntimeInfo",
    "SchedulerStats",
    "VisionCacheStats",
]


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
class RuntimeInfo:
    """What runs the model: the backend, its device, the weights' dtype and the KV
    format (`CacheConfig.kv_dtype`, `auto` when it is the model's dtype)."""

    backend: str
    device: str
    dtype: str
    kv_dtype: str
    # What the backend refuses whatever the model, by name, with why
    # (`Backend.refused_features`).
    refused: dict[str, str] = field(default_factory=dict)
    # How decode rows are computed (`Backend.decode_path`): "eager", or the compiled
    # step with its signature, or why it is not compiled.
    decode: str = "eager"


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
    runtime: RuntimeInfo | None = None
    # The requests' misses by reason, counted when the worker logs each request's
    # attribution (log level debug; `Worker._log_lookup`); empty otherwise.
    request_misses: dict[str, int] = field(default_factory=dict)
    # A VLM's encoder-row cache (`model.vision_cache`); None for a text model.
    vision: VisionCacheStats | None = None


@dataclass(frozen=True, slots=True)
class Accounting:
    """The engine's books, read on the worker thread between steps (so they agree).

    `pending_requests`: submitted and not yet reported done (what `max_queue`
    bounds); `queued_requests`: of those, not yet taken by the worker;
    `scheduled_requests`: requests with a sequence running or waiting.
    `kv_reserved_bytes`: what the scheduler has reserved of the KV budget (KV and
    snapshots of running sequences). A request the worker took but no sequence
    holds any more is a leaked slot; a reservation with nothing running is leaked
    memory."""

    pending_requests: int
    queued_requests: int
    scheduled_requests: int
    running: int
    waiting: int
    kv_reserved_bytes: int

    @property
    def balanced(self) -> bool:
        """Every pending request is queued or scheduled, and with no sequence running
        nothing is reserved."""
        slots = self.pending_requests == self.queued_requests + self.scheduled_requests
        return slots and (self.running > 0 or self.kv_reserved_bytes == 0)
