"""Prometheus metrics for one server app.

Every app gets its own `CollectorRegistry`: two apps in one process (tests,
an embedding application) must not share or clash over the global registry.
Request-level series are updated as requests finish; cache and pool series are
read from `engine.cache_stats()` at scrape time by a custom collector, so they
are never stale and cost nothing between scrapes. Totals the engine keeps
(tier hits, bytes written, dropped writes) are exported as counters, levels
(bytes used, allocated blocks) as gauges. This module is the one place where
the engine's typed statistics become Prometheus series (`_CacheCollector`) and
JSON (`stats_json`).

`pagedkv_explain_misses_total{reason, source}` counts misses by cause
(`cache.explain.REASONS`; every reason is exported, at 0 until seen):
`source="explain"` the answers of both explain routes that named a miss,
`source="request"` the generating requests' misses, counted when the worker logs
each request's attribution (log level debug, `Worker._log_lookup`); at any other
level the requests' lookups are not explained, which would cost a second walk of
the tiers' indexes per request.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.cache.explain import REASONS
from pagedkv.cache.pool import PoolStats
from pagedkv.engine.stats import EngineStats, VisionCacheStats
from pagedkv.storage.base import TierStats

log = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# TierStats fields that only grow, and those that go up and down.
_TIER_TOTALS = (
    "hits",
    "misses",
    "bytes_read",
    "bytes_written",
    "blocks_written",
    "writes_dropped",
    "corrupt",
    "errors",
)
_TIER_LEVELS = ("num_blocks", "bytes_used", "capacity_bytes")
_POOL_TOTALS = ("query_tokens", "hit_tokens", "evictions", "cow_copies")
_POOL_STATES = ("allocated", "free", "cached", "shared")
_POOL_SIZES = ("num_blocks", "max_blocks")


class ServerMetrics:
    """The series one app exports; `render()` is the body of GET /metrics."""

    def __init__(
        self, cache_stats: Callable[[], EngineStats], active_requests: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pagedkv_http_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedkv_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "pagedkv_cached_prompt_tokens", "Prompt tokens whose KV came from the cache", registry=r
        )
        self.generated_tokens = Counter("pagedkv_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "pagedkv_requests_finished",
            "Generation requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "pagedkv_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedkv_inter_token_latency_seconds",
            "Time between consecutive streamed tokens",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "pagedkv_requests_in_flight", "Requests the server is generating for now", registry=r
        )
        self._explained: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._explained_lock = threading.Lock()
        r.register(_CacheCollector(cache_stats, active_requests, self.explained))

    def observe_explain(self, reason: str) -> None:
        """One explain answer named a miss of `reason`."""
        with self._explained_lock:
            self._explained[reason] = self._explained.get(reason, 0) + 1

    def explained(self) -> dict[str, int]:
        with self._explained_lock:
            return dict(self._explained)

    def observe_result(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        finish_reasons: list[str],
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        self.generated_tokens.inc(completion_tokens)
        for reason in finish_reasons:
            self.finished.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CacheCollector(Collector):
    """Reads the engine's cache statistics at scrape time."""

    def __init__(
        self,
        cache_stats: Callable[[], EngineStats],
        active_requests: Callable[[], int],
        explained: Callable[[], dict[str, int]],
    ) -> None:
        self._cache_stats = cache_stats
        self._active_requests = active_requests
        self._explained = explained

    def describe(self) -> list[Metric]:
        return []  # unknown until the engine is asked; keeps registration side-effect free

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._cache_stats()
            active = self._active_requests()
        except Exception:  # a failing engine must not take /metrics down with it
            log.exception("reading cache statistics for /metrics failed")
            return
        yield GaugeMetricFamily(
            "pagedkv_engine_active_requests",
            "Requests queued or running in the engine",
            value=active,
        )
        yield _miss_metrics(self._explained(), stats.request_misses)
        if stats.cache is not None:
            yield from _tier_metrics(stats.cache.tiers)
            yield from _pool_metrics(stats.cache.pool)
        if stats.vision is not None:
            yield from _vision_metrics(stats.vision)


def _miss_metrics(explained: dict[str, int], requests: dict[str, int]) -> Metric:
    family = CounterMetricFamily(
        "pagedkv_explain_misses",
        "Misses by cause: of explain answers (source=explain) and of requests whose "
        "attribution the worker logged at debug level (source=request)",
        labels=["reason", "source"],
    )
    for source, counts in (("explain", explained), ("request", requests)):
        for reason in dict.fromkeys([*REASONS, *counts]):
            family.add_metric([reason, source], float(counts.get(reason, 0)))
    return family


def stats_json(stats: EngineStats) -> dict[str, Any]:
    """The body of GET /v1/cache/stats: the engine's figures, the cache's at the top level."""
    out: dict[str, Any] = {
        "model": stats.model,
        "prefix_caching": stats.prefix_caching,
        "caching_off_reason": stats.caching_off_reason,
        "requests": dataclasses.asdict(stats.requests),
    }
    if stats.runtime is not None:
        out["runtime"] = dataclasses.asdict(stats.runtime)
    if stats.scheduling is not None:
        out["scheduling"] = dataclasses.asdict(stats.scheduling)
    if stats.vision is not None:
        out["vision_cache"] = dataclasses.asdict(stats.vision)
    if stats.cache is not None:
        cache = stats.cache
        out.update(
            namespace=cache.namespace,
            block_size=cache.block_size,
            bytes_per_token=cache.bytes_per_token,
            pool=dataclasses.asdict(cache.pool),
            tiers={name: dataclasses.asdict(tier) for name, tier in cache.tiers.items()},
        )
    return out


def _vision_metrics(vision: VisionCacheStats) -> Iterator[Metric]:
    for field in ("hits", "misses", "encoder_calls"):
        yield CounterMetricFamily(
            f"pagedkv_vision_cache_{field}",
            f"Image encoder-row cache {field.replace('_', ' ')} since start",
            value=float(getattr(vision, field)),
        )
    for field in ("bytes", "capacity_bytes", "entries"):
        yield GaugeMetricFamily(
            f"pagedkv_vision_cache_{field}",
            f"Image encoder-row cache {field.replace('_', ' ')} now",
            value=float(getattr(vision, field)),
        )


def _tier_metrics(tiers: dict[str, TierStats]) -> Iterator[Metric]:
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for field in _TIER_TOTALS:
        families[field] = CounterMetricFamily(
            f"pagedkv_cache_tier_{field}",
            f"Cache tier {field} since it was opened",
            labels=["tier"],
        )
    for field in _TIER_LEVELS:
        families[field] = GaugeMetricFamily(
            f"pagedkv_cache_tier_{field}", f"Cache tier {field} now", labels=["tier"]
        )
    for name, tier in tiers.items():
        for field, family in families.items():
            family.add_metric([name], float(getattr(tier, field)))
    yield from families.values()


def _pool_metrics(pool: PoolStats) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        "pagedkv_pool_blocks", "Block pool blocks by state", labels=["state"]
    )
    for field in _POOL_STATES:
        blocks.add_metric([field], float(getattr(pool, field)))
    yield blocks
    for field in _POOL_SIZES:
        yield GaugeMetricFamily(
            f"pagedkv_pool_{field}", f"Block pool {field}", value=float(getattr(pool, field))
        )
    for field in _POOL_TOTALS:
        yield CounterMetricFamily(
            f"pagedkv_pool_{field}", f"Block pool {field} total", value=float(getattr(pool, field))
        )
    yield GaugeMetricFamily(
        "pagedkv_pool_hit_rate",
        "Prompt tokens served from the cache / tokens looked up",
        value=pool.hit_rate,
    )
