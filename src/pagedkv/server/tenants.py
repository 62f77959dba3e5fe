"""Each key's own figures, for `GET /v1/cache/stats` asked with a non-admin key.

The engine's counters and the cache's are global: they add up every tenant's
traffic, so showing them to every key would tell one tenant how much the others
send and how often they hit (and, over time, when). A tenant sees only what its
own requests did; admins and a single-user server see everything.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.request import GenerationResult
from pagedkv.server.auth import Tenant


@dataclass(slots=True)
class TenantFigures:
    """Totals over one key's finished requests since the server started."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the cache
    generated_tokens: int = 0
    cancelled: int = 0  # ended before every sample finished (disconnect, shutdown)
    running: int = 0

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["hit_rate"] = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return out


class TenantLedger:
    """`TenantFigures` by tenant salt; thread-safe. The single-user tenant is not kept."""

    def __init__(self) -> None:
        self._figures: dict[str, TenantFigures] = {}
        self._lock = threading.Lock()

    def started(self, tenant: Tenant) -> None:
        if tenant.salt is None:
            return
        with self._lock:
            self._figures.setdefault(tenant.salt, TenantFigures()).running += 1

    def finished(self, tenant: Tenant, results: list[GenerationResult], complete: bool) -> None:
        """Record a request that ended; `complete` False: it was cancelled or refused."""
        if tenant.salt is None:
            return
        with self._lock:
            figures = self._figures.setdefault(tenant.salt, TenantFigures())
            figures.running -= 1
            if not complete:
                figures.cancelled += 1
                return
            figures.requests += 1
            figures.prompt_tokens += results[0].prompt_tokens
            figures.cached_tokens += results[0].cached_tokens
            figures.generated_tokens += sum(len(r.token_ids) for r in results)

    def figures(self, tenant: Tenant) -> TenantFigures:
        with self._lock:
            return dataclasses.replace(self._figures.get(tenant.salt or "", TenantFigures()))
