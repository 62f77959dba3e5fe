"""The body of `GET /v1/dashboard/state`: everything the page shows, in one answer.

Shape (docs/usage.md, "Dashboard"): `overview` (the model, its namespace, runtime,
uptime, the batch and the KV budget), `cache` (exactly `GET /v1/cache/stats`'s
admin answer, so the page's figures are that endpoint's), `traffic` (2 s buckets
from `feed.py`), `tiers` (fill and counters now, and their samples over time from
`tiers.py`), `misses` (the last misses and totals by reason) and `tenants` (each
key's totals, and `leases`).

Sources a later part of the server fills in (`DashboardSources`): `leases`, the
leases each tenant holds (None: this server has no leases, and the page says so),
and `miss_reasons`, totals by reason kept elsewhere (a Prometheus counter per
reason); without it the totals are those of the misses explain answered here.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.request import GenerationResult
from pagedkv.engine.stats import EngineStats
from pagedkv.server.auth import Tenant
from pagedkv.server.dashboard.feed import DashboardFeed
from pagedkv.server.dashboard.tiers import TierHistory
from pagedkv.server.http_errors import REQUEST_ID
from pagedkv.server.metrics import stats_json


@dataclass
class DashboardSources:
    """Optional figures other parts of the server own; each a callable the state calls
    once per refresh, on a worker thread."""

    leases: Callable[[], list[dict[str, Any]]] | None = None
    miss_reasons: Callable[[], dict[str, int]] | None = None


@dataclass
class Dashboard:
    """What the dashboard keeps for one app (`ServerState.dashboard`)."""

    feed: DashboardFeed = field(default_factory=DashboardFeed)
    tiers: TierHistory = field(default_factory=TierHistory)
    sources: DashboardSources = field(default_factory=DashboardSources)
    started: float = field(default_factory=time.time)

    def finished(self, request_id: str, key: str, results: Sequence[GenerationResult]) -> None:
        """A generation request that completed: its samples' results, in index order."""
        first = results[0]
        self.feed.finished(
            request_id=request_id,
            key=key,
            prompt_tokens=first.prompt_tokens,
            cached_tokens=first.cached_tokens,
            cached=dict(first.tier_hits),
            generated_tokens=sum(len(r.token_ids) for r in results),
            ttft_s=first.ttft_s,
        )

    def explained(self, tenant: Tenant, answer: dict[str, Any]) -> None:
        """An explain answer with a miss (`server/explain.py`, `Explainer.on_miss`)."""
        miss = answer["miss"]
        self.feed.record_miss(
            request_id=REQUEST_ID.get(),
            key=tenant.label,
            position=miss["token_index"],
            prompt_tokens=answer["prompt_tokens"],
            reason=miss["reason"],
            section=miss.get("section"),
        )

    def state(
        self, model_name: str, stats: EngineStats, active: int, keys_enabled: bool
    ) -> dict[str, Any]:
        now = time.time()
        self.tiers.sample(now, stats)
        feed = self.feed.snapshot()
        reasons = feed["miss_reasons"]
        reason_source = "explain"
        if self.sources.miss_reasons is not None:
            reasons, reason_source = dict(self.sources.miss_reasons()), "counter"
        leases = self.sources.leases() if self.sources.leases is not None else None
        return {
            "now": now,
            "overview": _overview(model_name, stats, active, keys_enabled, now - self.started),
            "cache": stats_json(stats),
            "traffic": {"bucket_s": feed["bucket_s"], "buckets": feed["buckets"]},
            "tiers": _tiers(stats, self.tiers.series()),
            "misses": {
                "recent": feed["misses"],
                "reasons": reasons,
                "reason_source": reason_source,
            },
            "tenants": {"keys": feed["keys"], "leases": leases},
        }


def _overview(
    model_name: str, stats: EngineStats, active: int, keys_enabled: bool, uptime_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model_name,
        "engine_model": stats.model,
        "namespace": stats.cache.namespace if stats.cache is not None else None,
        "block_size": stats.cache.block_size if stats.cache is not None else None,
        "prefix_caching": stats.prefix_caching,
        "caching_off_reason": stats.caching_off_reason,
        "uptime_s": uptime_s,
        "active_requests": active,
        "keys": keys_enabled,
        "runtime": dataclasses.asdict(stats.runtime) if stats.runtime is not None else None,
        "requests": dataclasses.asdict(stats.requests),
    }
    s = stats.scheduling
    if s is not None:
        out.update(
            running=s.running,
            waiting=s.waiting,
            kv_budget_bytes=s.kv_budget_bytes,
            kv_reserved_bytes=s.kv_reserved_bytes,
            preemptions=s.preemptions,
        )
    return out


def _tiers(stats: EngineStats, history: list[dict[str, Any]]) -> dict[str, Any]:
    if stats.cache is None:
        return {"now": {}, "pool": None, "history": history}
    now = {}
    for name, t in stats.cache.tiers.items():
        tier = dataclasses.asdict(t)
        tier.pop("extra", None)
        now[name] = tier
    return {"now": now, "pool": dataclasses.asdict(stats.cache.pool), "history": history}
