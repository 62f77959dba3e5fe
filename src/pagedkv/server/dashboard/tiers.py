"""The tiers' levels over time: one sample of every tier's fill and counters per page
refresh, at most one per 2 s, in a bounded ring.

Fill levels and error counts are read from `engine.cache_stats()`, which asks the
SSD index and Redis, so they are sampled only while someone watches (each read of
`GET /v1/dashboard/state`), not in the background. Hit rates per tier over time come
from the requests themselves (`feed.py`), so they exist for the time nobody watched.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from pagedkv.engine.stats import EngineStats

MIN_INTERVAL_S = 1.5  # two pages open at once still sample about every 2 s
NUM_SAMPLES = 300


class TierHistory:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: deque[dict[str, Any]] = deque(maxlen=NUM_SAMPLES)

    def sample(self, now: float, stats: EngineStats) -> None:
        if stats.cache is None:
            return
        with self._lock:
            if self._samples and now - self._samples[-1]["t"] < MIN_INTERVAL_S:
                return
            point: dict[str, Any] = {"t": now, "evictions": stats.cache.pool.evictions}
            point["tiers"] = {
                name: {
                    "bytes_used": t.bytes_used,
                    "num_blocks": t.num_blocks,
                    "hits": t.hits,
                    "misses": t.misses,
                    "errors": t.errors,
                    "corrupt": t.corrupt,
                }
                for name, t in stats.cache.tiers.items()
            }
            self._samples.append(point)

    def series(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._samples)
