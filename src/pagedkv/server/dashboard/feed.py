"""What the dashboard remembers of the traffic: 2-second buckets in a bounded ring,
each key's totals, the last misses and the last requests.

The feed is filled as requests end (`DashboardFeed.finished`, from the generation's
close) and as explain answers (`record_miss`); nothing samples it in the background.
A bucket is closed when an event or a read falls in a later one, so an idle server
costs nothing, and a bucket with no traffic is simply absent (the page draws it as
zero). The rejected alternative, a sampling thread, would cost a wake-up every 2 s
whether or not anyone looks, and another thread for every app a process builds.

No prompt text is kept: a miss is its position, reason and section only, a request
its counts, so the dashboard cannot show one tenant another's words.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

BUCKET_S = 2.0
NUM_BUCKETS = 300  # ten minutes of 2 s buckets
NUM_MISSES = 50
NUM_REQUESTS = 256
MAX_TTFTS = 512  # per bucket; past it, later values replace earlier ones in turn


@dataclass(slots=True)
class Bucket:
    """The requests that ended in one 2 s interval starting at `start` (Unix time)."""

    start: float
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    cached: dict[str, int] = field(default_factory=dict)  # tier -> prompt tokens from it
    ttfts: list[float] = field(default_factory=list)
    misses: dict[str, int] = field(default_factory=dict)  # reason -> count

    def to_json(self) -> dict[str, Any]:
        ttft = sorted(self.ttfts)
        return {
            "t": self.start,
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached": dict(self.cached),
            "computed_tokens": self.prompt_tokens - self.cached_tokens,
            "ttft_p50": _quantile(ttft, 0.5),
            "ttft_p90": _quantile(ttft, 0.9),
            "misses": dict(self.misses),
        }


@dataclass(slots=True)
class KeyTotals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0

    def to_json(self, label: str) -> dict[str, Any]:
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return {
            "key": label,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "hit_rate": hit,
        }


@dataclass(frozen=True, slots=True)
class Miss:
    """Where a prompt stopped matching the cache. `reason` is explain's word (one of
    `cache.explain.REASONS`) or None when nothing explained it (a generation request:
    its lookup gives the position only); `section` is the prompt part named by
    explain (`server/sections.py`), None when unknown."""

    t: float
    request_id: str
    key: str
    position: int
    prompt_tokens: int
    reason: str | None
    section: dict[str, Any] | None
    source: str  # "request" or "explain"

    def to_json(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "request_id": self.request_id,
            "key": self.key,
            "position": self.position,
            "prompt_tokens": self.prompt_tokens,
            "reason": self.reason,
            "section": self.section,
            "source": self.source,
        }


UNEXPLAINED = "unexplained"  # the bucket key of a miss without a reason


class DashboardFeed:
    """Thread-safe: requests end on the event loop, the page reads from a worker thread.

    Invariants: buckets are in time order, at most `NUM_BUCKETS`, one per 2 s
    interval; every figure is a total over requests that ended (a cancelled one
    counts nothing, as in `/v1/cache/stats`)."""

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: deque[Bucket] = deque(maxlen=NUM_BUCKETS)
        self._keys: dict[str, KeyTotals] = {}
        self._misses: deque[Miss] = deque(maxlen=NUM_MISSES)
        self._requests: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._reasons: dict[str, int] = {}

    def _bucket(self, now: float) -> Bucket:
        start = now - now % BUCKET_S
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(Bucket(start))
        return self._buckets[-1]

    def finished(
        self,
        *,
        request_id: str,
        key: str,
        prompt_tokens: int,
        cached_tokens: int,
        cached: dict[str, int],
        generated_tokens: int,
        ttft_s: float | None,
    ) -> None:
        """A generation request that completed: its first sample's prompt, cached tokens
        and those per tier (`GenerationResult.tier_hits`), every sample's tokens."""
        now = self._clock()
        num_cached = cached_tokens
        with self._lock:
            b = self._bucket(now)
            b.requests += 1
            b.prompt_tokens += prompt_tokens
            b.cached_tokens += num_cached
            b.generated_tokens += generated_tokens
            for tier, n in cached.items():
                b.cached[tier] = b.cached.get(tier, 0) + n
            if ttft_s is not None:
                if len(b.ttfts) < MAX_TTFTS:
                    b.ttfts.append(ttft_s)
                else:
                    b.ttfts[b.requests % MAX_TTFTS] = ttft_s
            k = self._keys.setdefault(key, KeyTotals())
            k.requests += 1
            k.prompt_tokens += prompt_tokens
            k.cached_tokens += num_cached
            k.generated_tokens += generated_tokens
            self._requests[request_id] = {
                "request_id": request_id,
                "t": now,
                "key": key,
                "prompt_tokens": prompt_tokens,
                "cached": dict(cached),
                "cached_tokens": num_cached,
                "generated_tokens": generated_tokens,
                "ttft_s": ttft_s,
            }
            while len(self._requests) > NUM_REQUESTS:
                self._requests.popitem(last=False)
            # The last prompt token is always computed, for its logits: not a miss.
            if num_cached < prompt_tokens - 1:
                self._add_miss(
                    b, Miss(now, request_id, key, num_cached, prompt_tokens, None, None, "request")
                )

    def record_miss(
        self,
        *,
        request_id: str,
        key: str,
        position: int,
        prompt_tokens: int,
        reason: str,
        section: dict[str, Any] | None,
    ) -> None:
        """An explained miss: today `POST /v1/cache/explain` and `/v1/messages/explain`
        (`server/explain.py`). Whatever learns a generation request's reason can call
        this too; its count then shows in the reasons plot."""
        now = self._clock()
        with self._lock:
            b = self._bucket(now)
            miss = Miss(now, request_id, key, position, prompt_tokens, reason, section, "explain")
            self._add_miss(b, miss)

    def _add_miss(self, b: Bucket, miss: Miss) -> None:
        reason = miss.reason or UNEXPLAINED
        b.misses[reason] = b.misses.get(reason, 0) + 1
        self._reasons[reason] = self._reasons.get(reason, 0) + 1
        self._misses.append(miss)

    def request(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._requests.get(request_id)
            return dict(found) if found is not None else None

    def snapshot(self) -> dict[str, Any]:
        """The JSON parts the page plots: buckets (oldest first), each key's totals, the
        last misses (newest first) and the miss totals by reason."""
        now = self._clock()
        with self._lock:
            self._bucket(now)  # close the bucket in progress, so the series ends at now
            buckets = [b.to_json() for b in self._buckets]
            keys = [t.to_json(k) for k, t in sorted(self._keys.items())]
            misses = [m.to_json() for m in reversed(self._misses)]
            reasons = dict(self._reasons)
        return {
            "bucket_s": BUCKET_S,
            "buckets": buckets,
            "keys": keys,
            "misses": misses,
            "miss_reasons": reasons,
        }


def _quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank quantile of sorted `values`; None when there are none."""
    if not values:
        return None
    return values[max(0, math.ceil(q * len(values)) - 1)]
