"""A cache lookup's explanation in words: the caller's own tokens around the miss
decoded, times as dates.

Only the caller's prompt is ever quoted: `MissCause` carries no token of any
other request (see `pagedkv.cache.explain`), so neither the answer of
`POST /v1/cache/explain` nor the worker's debug line per request can show one.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.cache.explain import MissCause, PrefixExplanation

_CONTEXT = 8  # tokens of the caller's own prompt shown on each side of the miss


@dataclass(frozen=True, slots=True)
class MissReport:
    token_index: int
    reason: str  # "new" | "diverged" | "evicted"
    detail: str


@dataclass(frozen=True, slots=True)
class CacheExplanation:
    """What `POST /v1/cache/explain` answers (see docs/usage.md)."""

    prompt_tokens: int
    cached_tokens: int
    tiers: dict[str, int]
    miss: MissReport | None

    def to_json(self) -> dict[str, Any]:
        miss = None
        if self.miss is not None:
            m = self.miss
            miss = {"token_index": m.token_index, "reason": m.reason, "detail": m.detail}
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "tiers": dict(self.tiers),
            "miss": miss,
        }


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def _detail(m: MissCause, tokens: Sequence[int], decode: Callable[[Sequence[int]], str]) -> str:
    i = m.token_index
    if m.reason == "new":
        return (
            f"no earlier prompt of this key reached token {i} along this prefix: the "
            "first request with it computes it, later ones reuse it"
        )
    before = decode(tokens[max(0, i - _CONTEXT) : i])
    ours = decode(tokens[i : i + _CONTEXT])
    if m.reason == "diverged":
        return (
            f"an earlier prompt shared the first {i} tokens (ending {before!r}) and then "
            f"differed: this prompt continues {ours!r} (what the earlier one had there "
            "is not shown: it may be another user's)"
        )
    dep = m.departure
    assert dep is not None
    why = {
        "capacity": "evicted to make room",
        "lease_expired": "evicted to make room after their lease lapsed (expired, dropped, "
        "or displaced by newer leases past --max-leased-fraction)",
    }.get(dep.reason, "dropped by a cache clear")
    text = f"tokens from {i} on (after {before!r}) were cached; they left {dep.tier} at "
    text += f"{_when(dep.when)} ({why})"
    if m.lower_tiers:
        text += f" and no lower tier ({', '.join(m.lower_tiers)}) holds them now"
        if m.cleared_at is not None:
            text += f" (the cache was cleared at {_when(m.cleared_at)})"
        else:
            text += " (their own capacity eviction)"
    return text


def describe(
    exp: PrefixExplanation, tokens: Sequence[int], decode: Callable[[Sequence[int]], str]
) -> CacheExplanation:
    miss = None
    if exp.miss is not None:
        m = exp.miss
        miss = MissReport(m.token_index, m.reason, _detail(m, tokens, decode))
    return CacheExplanation(exp.prompt_tokens, exp.cached_tokens, exp.tiers, miss)


def caching_off(num_tokens: int, reason: str | None) -> CacheExplanation:
    detail = f"prefix caching is off ({reason or 'unknown reason'}): every token is computed"
    tiers = {"ram": 0, "ssd": 0, "redis": 0}
    return CacheExplanation(num_tokens, 0, tiers, MissReport(0, "new", detail))
