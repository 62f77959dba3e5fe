"""Per-request measurements, their summary per workload, the table, the JSON and the plot."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REUSE_TARGET = {
    "chat": 0.98,
    "agent": 0.98,
    "agent-reasoning": 0.98,
    "shared-prefix": 0.98,
    "restart": 0.95,
}


@dataclass(slots=True)
class RequestRecord:
    """One measured request: its cached-pass numbers, then its cold replay."""

    step: int
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ideal_tokens: int | None
    generated_tokens: int
    ttft_cached_s: float
    total_cached_s: float
    tier_hits: dict[str, int] = field(default_factory=dict)
    ttft_cold_s: float | None = None
    total_cold_s: float | None = None
    cold_cached_tokens: int | None = None  # must be 0: the cold pass reuses nothing
    same_output: bool | None = None  # cold greedy output == cached greedy output


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(
    *,
    workload: str,
    model: str,
    mode: str,
    records: Sequence[RequestRecord],
    cached_wall_s: float,
    cold_wall_s: float,
    wall_s: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One results.json record for a workload."""
    cached = [r.ttft_cached_s for r in records]
    cold = [r.ttft_cold_s for r in records if r.ttft_cold_s is not None]
    reused = sum(r.cached_tokens for r in records)
    ideal_known = all(r.ideal_tokens is not None for r in records)
    ideal = sum(r.ideal_tokens or 0 for r in records) if ideal_known else None
    hits: dict[str, int] = {}
    for r in records:
        for tier, n in r.tier_hits.items():
            hits[tier] = hits.get(tier, 0) + n
    generated = sum(r.generated_tokens for r in records)
    cold_med, cached_med = percentile(cold, 50), percentile(cached, 50)
    same = [r.same_output for r in records if r.same_output is not None]
    out: dict[str, Any] = {
        "workload": workload,
        "model": model,
        "mode": mode,
        "requests": len(records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "ttft_cold_median_s": cold_med,
        "ttft_cold_p90_s": percentile(cold, 90),
        "ttft_cached_median_s": cached_med,
        "ttft_cached_p90_s": percentile(cached, 90),
        "speedup": cold_med / cached_med if cold_med and cached_med else None,
        "reused_tokens": reused,
        "ideal_reused_tokens": ideal,
        "reuse_ratio": reused / ideal if ideal else None,
        "reuse_target": REUSE_TARGET.get(workload),
        "tier_hits": hits,
        "generated_tokens": generated,
        "generated_tokens_per_s": generated / cached_wall_s if cached_wall_s > 0 else None,
        "cold_generated_tokens_per_s": generated / cold_wall_s if cold_wall_s > 0 else None,
        "wall_s": wall_s,
        "cached_wall_s": cached_wall_s,
        "cold_wall_s": cold_wall_s,
        "cold_reused_tokens": sum(r.cold_cached_tokens or 0 for r in records),
        "outputs_compared": len(same),
        "outputs_identical": sum(same),
    }
    out.update(extra or {})
    out["per_request"] = [dataclasses.asdict(r) for r in records]
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def format_table(results: Sequence[dict[str, Any]]) -> str:
    head = (
        "workload",
        "reqs",
        "cold ms p50/p90",
        "cached ms p50/p90",
        "speedup",
        "reused/ideal",
        "ratio",
        "tier hits (tokens)",
        "KV B/token",
        "misses",
        "gen tok/s",
        "wall s",
    )
    rows = [head]
    for r in results:
        ideal = r["ideal_reused_tokens"]
        hits = ", ".join(f"{k} {v}" for k, v in sorted(r["tier_hits"].items()) if v) or "-"
        rows.append(
            (
                r["workload"],
                str(r["requests"]),
                f"{_ms(r['ttft_cold_median_s'])}/{_ms(r['ttft_cold_p90_s'])}",
                f"{_ms(r['ttft_cached_median_s'])}/{_ms(r['ttft_cached_p90_s'])}",
                "-" if r["speedup"] is None else f"{r['speedup']:.1f}x",
                f"{r['reused_tokens']}/{'-' if ideal is None else ideal}",
                "-" if r["reuse_ratio"] is None else f"{r['reuse_ratio']:.3f}",
                hits,
                str(r.get("kv_bytes_per_token") or "-"),  # a remote server does not say
                ", ".join(f"{k} {v}" for k, v in sorted((r.get("miss_reasons") or {}).items()))
                or "-",
                "-"
                if r["generated_tokens_per_s"] is None
                else f"{r['generated_tokens_per_s']:.1f}",
                f"{r['wall_s']:.0f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_json(results: Sequence[dict[str, Any]], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(list(results), indent=2, default=str) + "\n")
    tmp.replace(path)


def write_plot(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Per-request TTFT cold vs cached (log scale), and the reuse ratio per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    offset = 0
    for i, r in enumerate(results):
        reqs = r["per_request"]
        xs = list(range(offset, offset + len(reqs)))
        c = colors[i % len(colors)]
        cold = [q["ttft_cold_s"] * 1000 if q["ttft_cold_s"] else float("nan") for q in reqs]
        left.plot(xs, cold, "x--", color=c, alpha=0.6, label=f"{r['workload']} cold")
        left.plot(
            xs,
            [q["ttft_cached_s"] * 1000 for q in reqs],
            "o-",
            color=c,
            ms=3,
            label=f"{r['workload']} cached",
        )
        offset += len(reqs) + 2
    left.set_yscale("log")
    left.set_xlabel("request (in order, per workload)")
    left.set_ylabel("time to first token (ms)")
    left.set_title(f"TTFT per request, {results[0]['model'] if results else ''}")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7, ncol=2)

    names = [r["workload"] for r in results]
    ratios = [r["reuse_ratio"] or 0.0 for r in results]
    bars = right.bar(names, ratios, color=[colors[i % len(colors)] for i in range(len(names))])
    for bar, ratio in zip(bars, ratios, strict=True):
        right.annotate(
            f"{ratio:.3f}",
            (bar.get_x() + bar.get_width() / 2, ratio),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    for i, r in enumerate(results):
        target = REUSE_TARGET.get(r["workload"])
        if target is not None:
            right.hlines(
                target,
                i - 0.45,
                i + 0.45,
                color="k",
                ls="--",
                lw=0.9,
                label="target" if i == 0 else None,
            )
    right.set_ylim(0, 1.1)
    right.set_ylabel("reused / ideal reusable tokens")
    right.set_title("reuse vs an ideal token-level cache")
    right.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
