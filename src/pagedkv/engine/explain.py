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
from pagedkv.cache.prefix import PrefixCache, RequestCache

_CONTEXT = 8  # tokens of the caller's own prompt shown on each side of the miss


@dataclass(frozen=True, slots=True)
class MissReport:
    token_index: int
    reason: str  # one of `pagedkv.cache.explain.REASONS`
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


def _evicted(m: MissCause, before: str) -> str:
    i, dep = m.token_index, m.departure
    if dep is None:  # a sliding layer's window part of a lower-tier block is gone
        return (
            f"the cache holds the next {m.shared_tokens} tokens, but the sliding-window "
            f"layers' part of the block at token {i} (after {before!r}) is no longer in "
            f"{', '.join(m.lower_tiers) or 'any tier'}: the restore stops before it"
        )
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


def _identity(m: MissCause) -> str:
    idc = m.identity
    assert idc is not None
    what = ", ".join(idc.changed) if idc.changed else "the model fingerprint"
    theirs = f" ({idc.theirs})" if idc.theirs else ""
    return (
        f"{idc.tier} holds this prompt past token {m.token_index} under another model "
        f"namespace{theirs}: it was computed with another {what}, and KV is reused only "
        "by the model, KV dtype and kernel that computed it"
    )


def _detail(m: MissCause, tokens: Sequence[int], decode: Callable[[Sequence[int]], str]) -> str:
    i = m.token_index
    if m.reason == "new":
        return (
            f"no earlier prompt of this key reached token {i} along this prefix: the "
            "first request with it computes it, later ones reuse it"
        )
    before = decode(tokens[max(0, i - _CONTEXT) : i])
    ours = decode(tokens[i : i + _CONTEXT])
    if m.reason == "reasoning_stripped":
        return (
            f"an earlier prompt shared the first {i} tokens (ending {before!r}) and went on "
            f"with reasoning there, which this prompt's chat template dropped: it continues "
            f"{ours!r}. The template strips reasoning from earlier assistant turns; "
            "--reasoning-cache on stores each turn in this form after it ends"
        )
    if m.reason == "diverged":
        return (
            f"an earlier prompt shared the first {i} tokens (ending {before!r}) and then "
            f"differed: this prompt continues {ours!r} (what the earlier one had there "
            "is not shown: it may be another user's)"
        )
    if m.reason == "below_block":
        return (
            f"the cache holds the next {m.shared_tokens} tokens after token {i} (after "
            f"{before!r}), fewer than a block: this model keeps recurrent state, which "
            "is resumed only at the end of a full block, so they are recomputed"
        )
    if m.reason == "snapshot_missing":
        return (
            f"the cache holds KV for {m.shared_tokens} more tokens after token {i}, but "
            "not the recurrent-state snapshot at any later block boundary (evicted, or "
            "never taken there): this model resumes only where a snapshot is"
        )
    if m.reason == "identity_changed":
        return _identity(m)
    if m.reason == "image_changed":
        return (
            f"image {m.image_index} of this prompt differs from the one an earlier prompt "
            f"sent at the same place: the cache holds these tokens from token {i} (after "
            f"{before!r}) with another image's key, and KV computed over other pixels is "
            "never reused; the same image (the same decoded pixels) would hit"
        )
    if m.reason == "other_tenant":
        return (
            f"another tenant's requests cached this prompt past token {i}; tenants never "
            "share blocks (each key hashes under its own salt), so this key computes it "
            "once for itself"
        )
    if m.reason in ("evicted", "lease_expired"):
        return _evicted(m, before)
    return f"token {i} (after {before!r}) is recomputed: {m.reason}"


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


def lookup_line(
    prefix: PrefixCache,
    tokens: list[int],
    handle: RequestCache,
    decode: Callable[[Sequence[int]], str],
    miss_reasons: dict[str, int],
) -> str:
    """The attribution `POST /v1/cache/explain` would give for a request the worker is
    starting, as its debug line; the reason is counted in `miss_reasons`
    (`pagedkv_explain_misses_total`)."""
    found = prefix.explain(tokens, handle.extra, chain=handle.chain)
    exp = describe(found, tokens, decode)
    miss = exp.miss
    if miss is not None:
        miss_reasons[miss.reason] = miss_reasons.get(miss.reason, 0) + 1
    cause = "no miss"
    if miss is not None:
        cause = f"miss at {miss.token_index}: {miss.reason}, {miss.detail}"
    return (
        f"prefix lookup: {exp.cached_tokens} of {exp.prompt_tokens} prompt tokens "
        f"cached {exp.tiers}; {cause}"
    )
