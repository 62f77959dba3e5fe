// Small SVG plots for the dashboard: lines and stacked bars over a time axis.
// No library: the page must work offline and load only its own files.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 460, H = 180, L = 58, R = 8, T = 8, B = 34;
  const PALETTE = ["#4fa3ff", "#4caf7a", "#e0a43a", "#c678dd", "#e05a5a", "#56b6c2", "#abb2bf"];

  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  function fmtNum(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 10) return v.toFixed(0);
    if (a >= 1) return v.toFixed(1);
    return v.toPrecision(2);
  }

  function frame(svg, t0, t1, ymax, yFmt) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("preserveAspectRatio", "none");
    const x = (t) => L + ((t - t0) / Math.max(1e-9, t1 - t0)) * (W - L - R);
    const y = (v) => H - B - (v / ymax) * (H - T - B);
    el("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" }, svg);
    el("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" }, svg);
    for (const f of [0, 0.5, 1]) {
      const v = ymax * f;
      el("line", { x1: L - 3, y1: y(v), x2: W - R, y2: y(v), class: "axis", "stroke-dasharray": f ? "2,3" : "" }, svg);
      el("text", { x: L - 5, y: y(v) + 3, "text-anchor": "end" }, svg).textContent = (yFmt || fmtNum)(v);
    }
    const span = t1 - t0;
    el("text", { x: L, y: H - B + 12, "text-anchor": "start" }, svg).textContent =
      "-" + Math.round(span / 60) + " min";
    el("text", { x: W - R, y: H - B + 12, "text-anchor": "end" }, svg).textContent = "now";
    return { x, y };
  }

  function legend(svg, series) {
    let x = L;
    series.forEach((s) => {
      el("rect", { x, y: H - 12, width: 9, height: 9, fill: s.color }, svg);
      const t = el("text", { x: x + 12, y: H - 4, class: "legend" }, svg);
      t.textContent = s.name;
      x += 20 + 6.5 * s.name.length;
    });
  }

  function colors(series) {
    series.forEach((s, i) => { s.color = s.color || PALETTE[i % PALETTE.length]; });
  }

  // series: [{name, points: [[t, v or null]]}]; a null breaks the line.
  function lines(svg, series, t0, t1, yFmt) {
    colors(series);
    let max = 0;
    series.forEach((s) => s.points.forEach((p) => { if (p[1] != null && p[1] > max) max = p[1]; }));
    const { x, y } = frame(svg, t0, t1, niceMax(max), yFmt);
    series.forEach((s) => {
      const runs = [];
      let run = [];
      s.points.forEach(([t, v]) => {
        if (v == null || t < t0) { if (run.length) runs.push(run); run = []; return; }
        run.push([x(t), y(v)]);
      });
      if (run.length) runs.push(run);
      let d = "";
      runs.forEach((r) => r.forEach(([px, py], i) => { d += (i ? "L" : "M") + px.toFixed(1) + "," + py.toFixed(1); }));
      if (d) el("path", { d, class: "line", stroke: s.color, "data-series": s.name }, svg);
      // A lone sample (a bucket between two empty ones) is a dot, not an invisible line.
      runs.filter((r) => r.length === 1).forEach(([[px, py]]) => el("circle", { cx: px, cy: py, r: 3, fill: s.color }, svg));
    });
    legend(svg, series);
  }

  // times: bucket starts; series: [{name, values: [...] (one per time)}]; width in seconds.
  function stacked(svg, times, series, width, t0, t1, yFmt) {
    colors(series);
    let max = 0;
    times.forEach((_, i) => {
      const sum = series.reduce((a, s) => a + (s.values[i] || 0), 0);
      if (sum > max) max = sum;
    });
    const { x, y } = frame(svg, t0, t1, niceMax(max), yFmt);
    const w = Math.max(1, x(t0 + width) - x(t0) - 0.5);
    times.forEach((t, i) => {
      if (t < t0) return;
      let base = 0;
      series.forEach((s) => {
        const v = s.values[i] || 0;
        if (v > 0) {
          el("rect", { x: x(t), y: y(base + v), width: w, height: y(base) - y(base + v), fill: s.color }, svg);
        }
        base += v;
      });
    });
    legend(svg, series);
  }

  window.PKPlot = { lines, stacked, fmtNum };
})();
