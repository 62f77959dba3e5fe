"""The bench's summary numbers, table and plot from hand-made measurements."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.bench.report import (
    RequestRecord,
    format_table,
    percentile,
    summarize,
    write_json,
    write_plot,
)


def _rec(
    step: int, cached: int, ideal: int | None, ttft: float, cold: float | None, hits: dict[str, int]
) -> RequestRecord:
    return RequestRecord(
        step=step,
        session=0,
        turn=step,
        prompt_tokens=100,
        cached_tokens=cached,
        ideal_tokens=ideal,
        generated_tokens=10,
        ttft_cached_s=ttft,
        total_cached_s=ttft + 0.5,
        tier_hits=hits,
        ttft_cold_s=cold,
        total_cold_s=None if cold is None else cold + 0.5,
        cold_cached_tokens=0,
        same_output=True,
    )


def test_percentile_interpolates() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 90) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([float(i) for i in range(11)], 90) == pytest.approx(9.0)


def test_summary_adds_up_the_requests() -> None:
    records = [
        _rec(0, 0, 0, 0.40, 0.40, {}),
        _rec(1, 60, 64, 0.10, 0.50, {"ram": 60}),
        _rec(2, 90, 90, 0.05, 0.60, {"ram": 64, "ssd": 26}),
    ]
    s = summarize(
        workload="chat",
        model="m",
        mode="local",
        records=records,
        cached_wall_s=2.0,
        cold_wall_s=3.0,
        wall_s=6.0,
        extra={"kv_bytes_per_token": 23040},
    )
    head, _, row = format_table([s]).splitlines()
    assert "KV B/token" in head and " 23040 " in row
    assert s["requests"] == 3
    assert s["reused_tokens"] == 150 and s["ideal_reused_tokens"] == 154
    assert s["reuse_ratio"] == pytest.approx(150 / 154)
    assert s["tier_hits"] == {"ram": 124, "ssd": 26}
    assert s["ttft_cached_median_s"] == pytest.approx(0.10)
    assert s["ttft_cold_median_s"] == pytest.approx(0.50)
    assert s["speedup"] == pytest.approx(5.0)
    assert s["generated_tokens_per_s"] == pytest.approx(15.0)
    assert s["outputs_identical"] == s["outputs_compared"] == 3
    assert len(s["per_request"]) == 3


def test_unknown_ideal_gives_no_ratio(tmp_path: Path) -> None:
    s = summarize(
        workload="agent",
        model="m",
        mode="url",
        records=[_rec(0, 5, None, 0.1, None, {})],
        cached_wall_s=1.0,
        cold_wall_s=0.0,
        wall_s=1.0,
    )
    assert s["ideal_reused_tokens"] is None and s["reuse_ratio"] is None
    assert s["speedup"] is None
    table = format_table([s])
    assert "agent" in table and table.count("\n") == 2
    write_json([s], tmp_path / "r.json")
    write_plot([s], tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_html_report_is_self_contained_with_its_plots(tmp_path: Path) -> None:
    from pagedkv.bench.html_report import write_html

    runs = [
        summarize(
            workload=name,
            model="<tiny & model>",
            mode="local",
            records=[
                _rec(0, 0, 0, 0.2, 0.2, {}),
                _rec(1, 90, 92, 0.02, 0.3, {"ram": 60, "ssd": 30}),
            ],
            cached_wall_s=1.0,
            cold_wall_s=2.0,
            wall_s=3.0,
        )
        for name in ("chat", "restart")
    ]
    write_html(runs, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert page.count("<svg") == 3 and page.count("<path") == 4  # cold and cached per workload
    assert "&lt;tiny &amp; model&gt;" in page and "<tiny" not in page
    assert page.replace('xmlns="http://www.w3.org/2000/svg"', "").count("http") == 0
    assert "<script" not in page and "<link" not in page and "src=" not in page
    assert format_table(runs).splitlines()[2].split()[0] in page
