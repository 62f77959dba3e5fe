"""`report.html`: the bench's results as one self-contained page beside results.json.

Everything is inline (styles and SVG plots drawn here), so the file opens offline,
can be mailed or attached to an issue, and fetches nothing. Plots: each request's
time to first token, cold and cached, per workload (log scale); reuse against the
ideal cache with its target; prompt tokens per tier; and the table `pagedkv bench`
prints. Text from the results is escaped.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.bench.report import REUSE_TARGET, format_table

W, H, L, R, T, B = 640, 240, 56, 10, 12, 36
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf")
_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#1d232a;max-width:1400px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
pre{background:#f4f6f8;padding:10px;overflow-x:auto;font-size:12px}
.plots{display:flex;flex-wrap:wrap;gap:16px}
figure{margin:0;border:1px solid #dde2e6;border-radius:6px;padding:8px}
figcaption{font-size:12px;color:#5b6670}
svg text{font-size:10px;fill:#5b6670}
"""


def _svg(body: list[str]) -> str:
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}">{"".join(body)}</svg>'


def _axes(ymax: float, labels: Sequence[tuple[float, str]], xlabel: str) -> list[str]:
    out = [
        f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="#999"/>',
        f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="#999"/>',
        f'<text x="{(L + W - R) / 2}" y="{H - 4}" text-anchor="middle">'
        f"{html.escape(xlabel)}</text>",
    ]
    for y, text in labels:
        out.append(f'<line x1="{L - 3}" y1="{y:.1f}" x2="{W - R}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(
            f'<text x="{L - 5}" y="{y + 3:.1f}" text-anchor="end">{html.escape(text)}</text>'
        )
    return out


def _legend(names: Sequence[tuple[str, str]]) -> list[str]:
    out, x = [], L + 6
    for name, color in names:
        out.append(f'<rect x="{x}" y="{T}" width="9" height="9" fill="{color}"/>')
        out.append(f'<text x="{x + 12}" y="{T + 8}">{html.escape(name)}</text>')
        x += 24 + 6 * len(name)
    return out


def ttft_plot(results: Sequence[dict[str, Any]]) -> str:
    """Every request's TTFT in ms, cold (dashed) and cached (solid), log scale."""
    series: list[tuple[str, str, list[tuple[int, float]], bool]] = []
    offset = 0
    for i, r in enumerate(results):
        color = PALETTE[i % len(PALETTE)]
        reqs = r["per_request"]
        cold = [
            (offset + j, q["ttft_cold_s"] * 1000) for j, q in enumerate(reqs) if q["ttft_cold_s"]
        ]
        cached = [(offset + j, q["ttft_cached_s"] * 1000) for j, q in enumerate(reqs)]
        series.append((f"{r['workload']} cold", color, cold, True))
        series.append((f"{r['workload']} cached", color, cached, False))
        offset += len(reqs) + 2
    values = [v for *_, pts, _ in series for _, v in pts if v > 0]
    if not values:
        return _svg(_axes(1, [], "no requests"))
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    hi = max(hi, lo + 1)
    x = lambda i: L + i / max(1, offset - 2) * (W - L - R)  # noqa: E731
    y = lambda v: H - B - (math.log10(max(v, 10**lo)) - lo) / (hi - lo) * (H - T - B)  # noqa: E731
    ticks = [(y(10**e), f"{10**e:g} ms") for e in range(lo, hi + 1)]
    body = _axes(10**hi, ticks, "request (in order, per workload)")
    for _, color, pts, dashed in series:
        if not pts:
            continue
        d = " ".join(
            f"{'M' if k == 0 else 'L'}{x(i):.1f},{y(v):.1f}" for k, (i, v) in enumerate(pts)
        )
        dash = ' stroke-dasharray="4,3" opacity="0.6"' if dashed else ""
        body.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.5"{dash}/>')
    body += _legend([(name, color) for name, color, _, dashed in series if not dashed])
    return _svg(body)


def _bars(
    names: Sequence[str], stacks: Sequence[Sequence[tuple[str, float, str]]], ymax: float,
    fmt: str, targets: Sequence[float | None] = (),
) -> list[str]:  # fmt: skip
    ymax = ymax or 1.0
    y = lambda v: H - B - v / ymax * (H - T - B - 14)  # noqa: E731
    slot = (W - L - R) / max(1, len(names))
    body = _axes(ymax, [(y(ymax * f), format(ymax * f, fmt)) for f in (0, 0.5, 1)], "workload")
    for i, (name, stack) in enumerate(zip(names, stacks, strict=True)):
        x0, base = L + i * slot + slot * 0.2, 0.0
        for _, v, color in stack:
            body.append(
                f'<rect x="{x0:.1f}" y="{y(base + v):.1f}" width="{slot * 0.6:.1f}" '
                f'height="{y(base) - y(base + v):.1f}" fill="{color}"/>'
            )
            base += v
        body.append(
            f'<text x="{x0 + slot * 0.3:.1f}" y="{H - B + 12}" text-anchor="middle">'
            f"{html.escape(name)}</text>"
        )
        target = targets[i] if i < len(targets) else None
        if target is not None:
            body.append(
                f'<line x1="{x0 - 4:.1f}" x2="{x0 + slot * 0.6 + 4:.1f}" y1="{y(target):.1f}" '
                f'y2="{y(target):.1f}" stroke="#000" stroke-dasharray="4,3"/>'
            )
    return body


def reuse_plot(results: Sequence[dict[str, Any]]) -> str:
    """Reused / ideal reusable tokens per workload; the dashed line is its target."""
    names = [r["workload"] for r in results]
    stacks = [
        [("reuse", r["reuse_ratio"] or 0.0, PALETTE[i % len(PALETTE)])]
        for i, r in enumerate(results)
    ]
    targets = [REUSE_TARGET.get(n) for n in names]
    return _svg(_bars(names, stacks, 1.0, ".2f", targets))


def tier_plot(results: Sequence[dict[str, Any]]) -> str:
    """Prompt tokens per workload: from each tier, and computed."""
    tiers = sorted({t for r in results for t in r["tier_hits"]})
    colors = {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(tiers)}
    stacks = []
    for r in results:
        stack = [(t, float(r["tier_hits"].get(t, 0)), colors[t]) for t in tiers]
        computed = r["prompt_tokens"] - sum(r["tier_hits"].values())
        stacks.append([*stack, ("computed", float(max(0, computed)), "#aab3bb")])
    ymax = max((sum(v for _, v, _ in s) for s in stacks), default=1.0)
    body = _bars([r["workload"] for r in results], stacks, ymax, ".0f")
    body += _legend([*colors.items(), ("computed", "#aab3bb")])
    return _svg(body)


def render_html(results: Sequence[dict[str, Any]]) -> str:
    model = html.escape(str(results[0]["model"])) if results else "-"
    figures = [
        ("Time to first token per request, cold (dashed) and cached", ttft_plot(results)),
        ("Reuse against an ideal token-level cache (dashed: target)", reuse_plot(results)),
        ("Prompt tokens by tier, and computed", tier_plot(results)),
    ]
    plots = "".join(
        f"<figure><figcaption>{html.escape(c)}</figcaption>{svg}</figure>" for c, svg in figures
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>pagedkv bench: {model}</title><style>{_STYLE}</style></head><body>"
        f"<h1>pagedkv bench: {model}</h1>"
        f'<div class="plots">{plots}</div>'
        f"<h2>Results</h2><pre>{html.escape(format_table(results))}</pre>"
        "<p>The figures behind this page are in results.json beside it.</p>"
        "</body></html>\n"
    )


def write_html(results: Sequence[dict[str, Any]], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(render_html(results), encoding="utf-8")
    tmp.replace(path)
