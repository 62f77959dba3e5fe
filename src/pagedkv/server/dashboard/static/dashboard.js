// The dashboard page: log in (admin key in sessionStorage), poll GET /v1/dashboard/state
// every 2 s and draw every panel from that one answer.
"use strict";
(function () {
  const STATE_URL = "/v1/dashboard/state";
  const KEY = "pagedkv-admin-key";
  const POLL_MS = 2000;
  const WINDOW_S = 600;
  const $ = (id) => document.getElementById(id);
  const fmt = (v) => window.PKPlot.fmtNum(v);
  let timer = null;

  function authHeaders() {
    const key = sessionStorage.getItem(KEY);
    return key ? { Authorization: "Bearer " + key } : {};
  }

  function bytes(v) {
    if (v == null) return "-";
    const u = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (v >= 1024 && i < u.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(v >= 100 ? 0 : 1) : String(Math.round(v))) + " " + u[i];
  }
  const pct = (v) => (v == null ? "-" : (100 * v).toFixed(1) + " %");
  const int = (v) => (v == null ? "-" : Number(v).toLocaleString("en-US"));
  function duration(s) {
    s = Math.floor(s);
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
    return (d ? d + "d " : "") + (d || h ? h + "h " : "") + m + "m " + (s % 60) + "s";
  }

  function cell(tag, text, stat, value) {
    const e = document.createElement(tag);
    e.textContent = text;
    if (stat) e.dataset.stat = stat;
    if (value !== undefined && value !== null) e.dataset.value = String(value);
    return e;
  }

  function card(parent, label, text, stat, value, small) {
    const c = document.createElement("div");
    c.className = "card";
    c.appendChild(cell("div", label)).className = "k";
    c.appendChild(cell("div", text, stat, value)).className = String(text).length > 24 ? "v long" : "v";
    if (small) c.appendChild(cell("div", small)).className = "small";
    parent.appendChild(c);
  }

  function rows(table, pairs) {
    table.replaceChildren();
    pairs.forEach(([label, text, stat, value]) => {
      const tr = document.createElement("tr");
      tr.appendChild(cell("td", label));
      tr.appendChild(cell("td", text, stat, value));
      table.appendChild(tr);
    });
  }

  function gridRows(tbody, items, columns) {
    tbody.replaceChildren();
    items.forEach((item) => {
      const tr = document.createElement("tr");
      columns.forEach((c) => tr.appendChild(cell("td", c(item))));
      tbody.appendChild(tr);
    });
  }

  // -- panels ---------------------------------------------------------------

  function overview(s) {
    const o = s.overview, c = s.cache;
    $("model-name").textContent = o.model;
    const box = $("overview-cards");
    box.replaceChildren();
    const rt = o.runtime || {};
    card(box, "model", o.model, "overview.model", o.model, o.engine_model !== o.model ? o.engine_model : "");
    card(box, "identity (namespace)", o.namespace || "caching off", "overview.namespace", o.namespace,
      o.prefix_caching ? "block size " + o.block_size + " tokens" : o.caching_off_reason);
    card(box, "backend", (rt.backend || "-") + " on " + (rt.device || "-"), "overview.backend", rt.backend);
    card(box, "dtype / kv_dtype", (rt.dtype || "-") + " / " + (rt.kv_dtype || "-"), "overview.dtype", rt.dtype);
    card(box, "uptime", duration(o.uptime_s), "overview.uptime_s", o.uptime_s);
    card(box, "running / waiting", int(o.running) + " / " + int(o.waiting), "overview.running", o.running);
    card(box, "requests finished", int(o.requests.requests), "overview.requests", o.requests.requests);
    const hit = c.pool ? c.pool.hit_rate : null;
    card(box, "prompt tokens from cache", pct(hit), "pool.hit_rate", hit);
    const budget = o.kv_budget_bytes || 0, used = o.kv_reserved_bytes || 0;
    $("kv-budget").querySelector(".fill").style.width = budget ? (100 * used / budget).toFixed(1) + "%" : "0";
    const label = $("kv-budget").querySelector(".label");
    label.textContent = bytes(used) + " reserved of " + bytes(budget);
    label.dataset.stat = "scheduling.kv_reserved_bytes";
    label.dataset.value = String(used);
    const r = c.requests, p = c.pool || {};
    const pairs = [
      ["requests", int(r.requests), "requests.requests", r.requests],
      ["prompt tokens", int(r.prompt_tokens), "requests.prompt_tokens", r.prompt_tokens],
      ["cached prompt tokens", int(r.cached_tokens), "requests.cached_tokens", r.cached_tokens],
      ["generated tokens", int(r.generated_tokens), "requests.generated_tokens", r.generated_tokens],
      ["cancelled", int(r.cancelled), "requests.cancelled", r.cancelled],
      ["errors", int(r.errors), "requests.errors", r.errors],
    ];
    if (c.pool) {
      pairs.push(["tokens looked up", int(p.query_tokens), "pool.query_tokens", p.query_tokens]);
      pairs.push(["tokens hit in RAM", int(p.hit_tokens), "pool.hit_tokens", p.hit_tokens]);
      pairs.push(["RAM blocks cached / max", int(p.cached) + " / " + int(p.max_blocks), "pool.cached", p.cached]);
      pairs.push(["RAM evictions", int(p.evictions), "pool.evictions", p.evictions]);
    }
    if (c.scheduling) pairs.push(["preemptions", int(c.scheduling.preemptions), "scheduling.preemptions", c.scheduling.preemptions]);
    rows($("cache-totals"), pairs);
  }

  // Every bucket start in the window, so that an absent bucket (no traffic) plots as zero.
  function grid(now, width) {
    const out = [];
    for (let t = Math.floor((now - WINDOW_S) / width) * width; t <= now; t += width) out.push(t);
    return out;
  }

  function traffic(s) {
    const w = s.traffic.bucket_s, now = s.now, t0 = now - WINDOW_S;
    const byT = new Map(s.traffic.buckets.map((b) => [b.t, b]));
    const times = grid(now, w);
    const at = (t) => byT.get(t);
    const rate = (f) => times.map((t) => [t, at(t) ? f(at(t)) / w : 0]);
    PKPlot.lines($("chart-rps"), [{ name: "requests/s", points: rate((b) => b.requests) }], t0, now);
    PKPlot.lines($("chart-tps"), [{ name: "tokens/s", points: rate((b) => b.generated_tokens) }], t0, now);
    const q = (k) => times.map((t) => [t, at(t) ? at(t)[k] : null]);
    PKPlot.lines($("chart-ttft"), [{ name: "p50", points: q("ttft_p50") }, { name: "p90", points: q("ttft_p90") }], t0, now);
    const tiers = tierNames(s);
    const series = tiers.map((name) => ({ name: "cached " + name, values: times.map((t) => (at(t) ? (at(t).cached[name] || 0) / w : 0)) }));
    series.push({ name: "computed", color: "#8b96a1", values: times.map((t) => (at(t) ? at(t).computed_tokens / w : 0)) });
    PKPlot.stacked($("chart-prompt"), times, series, w, t0, now);
  }

  function tierNames(s) {
    const names = Object.keys(s.tiers.now);
    s.traffic.buckets.forEach((b) => Object.keys(b.cached).forEach((n) => { if (!names.includes(n)) names.push(n); }));
    return names;
  }

  function tiers(s) {
    const box = $("tier-cards");
    box.replaceChildren();
    for (const [name, t] of Object.entries(s.tiers.now)) {
      const fill = t.capacity_bytes ? t.bytes_used / t.capacity_bytes : null;
      const c = document.createElement("div");
      c.className = "card";
      c.dataset.tier = name;
      c.appendChild(cell("div", name.toUpperCase() + (t.location ? " " + t.location : ""))).className = "k";
      c.appendChild(cell("div", bytes(t.bytes_used) + " of " + bytes(t.capacity_bytes), "tiers." + name + ".bytes_used", t.bytes_used)).className = "v";
      const bar = document.createElement("div");
      bar.className = "bar";
      const f = document.createElement("div");
      f.className = "fill";
      f.style.width = fill == null ? "0" : (100 * Math.min(1, fill)).toFixed(1) + "%";
      bar.appendChild(f);
      c.appendChild(bar);
      const t2 = document.createElement("table");
      t2.className = "kv";
      rows(t2, [
        ["blocks", int(t.num_blocks), "tiers." + name + ".num_blocks", t.num_blocks],
        ["hits", int(t.hits), "tiers." + name + ".hits", t.hits],
        ["misses", int(t.misses), "tiers." + name + ".misses", t.misses],
        ["errors", int(t.errors), "tiers." + name + ".errors", t.errors],
        ["corrupt", int(t.corrupt), "tiers." + name + ".corrupt", t.corrupt],
        ["writes dropped", int(t.writes_dropped), "tiers." + name + ".writes_dropped", t.writes_dropped],
      ]);
      c.appendChild(t2);
      box.appendChild(c);
    }
    if (s.tiers.pool) {
      card(box, "RAM evictions", int(s.tiers.pool.evictions), "tiers.pool.evictions", s.tiers.pool.evictions);
    }
    const w = s.traffic.bucket_s, now = s.now, t0 = now - WINDOW_S;
    const byT = new Map(s.traffic.buckets.map((b) => [b.t, b]));
    const times = grid(now, w);
    const share = tierNames(s).map((name) => ({
      name,
      points: times.map((t) => { const b = byT.get(t); return [t, b && b.prompt_tokens ? (b.cached[name] || 0) / b.prompt_tokens : null]; }),
    }));
    PKPlot.lines($("chart-tier-hits"), share, t0, now, (v) => (100 * v).toFixed(0) + "%");
    const hist = s.tiers.history;
    const fill = Object.keys(s.tiers.now).map((name) => ({ name, points: hist.map((h) => [h.t, h.tiers[name] ? h.tiers[name].bytes_used : null]) }));
    PKPlot.lines($("chart-tier-fill"), fill, t0, now, (v) => bytes(v));
    const ev = hist.slice(1).map((h, i) => [h.t, h.evictions - hist[i].evictions]);
    PKPlot.lines($("chart-evictions"), [{ name: "evictions", points: ev }], t0, now);
  }

  function misses(s) {
    const w = s.traffic.bucket_s, now = s.now, t0 = now - WINDOW_S;
    const byT = new Map(s.traffic.buckets.map((b) => [b.t, b]));
    const times = grid(now, w);
    const reasons = [];
    s.traffic.buckets.forEach((b) => Object.keys(b.misses).forEach((r) => { if (!reasons.includes(r)) reasons.push(r); }));
    Object.keys(s.misses.reasons).forEach((r) => { if (!reasons.includes(r)) reasons.push(r); });
    reasons.sort();
    const series = reasons.map((r) => ({ name: r, values: times.map((t) => (byT.get(t) ? byT.get(t).misses[r] || 0 : 0)) }));
    PKPlot.stacked($("chart-misses"), times, series, w, t0, now);
    const totals = Object.entries(s.misses.reasons).sort((a, b) => b[1] - a[1]);
    rows($("miss-reasons"), totals.map(([r, n]) => [r, int(n), "misses.reasons." + r, n]));
    $("reason-source").textContent = s.misses.reason_source === "explain"
      ? "(reasons of the misses explain answered; generation requests' misses are 'unexplained')"
      : "(from the server's miss counters)";
    const section = (m) => (m.section ? m.section.kind + (m.section.message_index != null ? " #" + m.section.message_index : "") + (m.section.role ? " (" + m.section.role + ")" : "") : "-");
    gridRows($("miss-table").querySelector("tbody"), s.misses.recent, [
      (m) => new Date(m.t * 1000).toLocaleTimeString(), (m) => m.key, (m) => int(m.position),
      (m) => int(m.prompt_tokens), section, (m) => m.reason || "unexplained", (m) => m.source,
    ]);
  }

  function tenants(s) {
    gridRows($("tenant-table").querySelector("tbody"), s.tenants.keys, [
      (k) => k.key, (k) => int(k.requests), (k) => int(k.prompt_tokens), (k) => int(k.cached_tokens),
      (k) => int(k.generated_tokens), (k) => pct(k.hit_rate),
    ]);
    const box = $("leases");
    box.replaceChildren();
    const leases = s.tenants.leases;
    if (leases == null) {
      box.appendChild(cell("p", "This server keeps no leases.")).className = "muted";
    } else if (!leases.length) {
      box.appendChild(cell("p", "No lease is held.")).className = "muted";
    } else {
      const cols = Object.keys(leases[0]);
      const table = document.createElement("table");
      table.className = "grid";
      const head = document.createElement("tr");
      cols.forEach((c) => head.appendChild(cell("th", c)));
      table.appendChild(head);
      const body = document.createElement("tbody");
      gridRows(body, leases, cols.map((c) => (l) => String(l[c])));
      table.appendChild(body);
      box.appendChild(table);
    }
  }

  // -- loop -------------------------------------------------------------------

  function render(s) {
    overview(s);
    traffic(s);
    tiers(s);
    misses(s);
    tenants(s);
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  }

  function showLogin(message) {
    clearTimeout(timer);
    $("main").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("login-error").textContent = message || "";
    $("status").textContent = "locked";
  }

  async function poll() {
    let resp;
    try {
      resp = await fetch(STATE_URL, { headers: authHeaders(), cache: "no-store" });
    } catch (e) {
      $("status").textContent = "server unreachable, retrying";
      timer = setTimeout(poll, POLL_MS);
      return;
    }
    if (resp.status === 401 || resp.status === 403) {
      const body = await resp.json().catch(() => ({}));
      const had = sessionStorage.getItem(KEY);
      sessionStorage.removeItem(KEY);
      const text = body.error ? body.error.message : "refused";
      showLogin(resp.status === 401 && !had ? "" : text);
      return;
    }
    if (!resp.ok) {
      $("status").textContent = "error " + resp.status + ", retrying";
      timer = setTimeout(poll, POLL_MS);
      return;
    }
    const s = await resp.json();
    $("login").hidden = true;
    $("main").hidden = false;
    $("logout").hidden = !sessionStorage.getItem(KEY);
    render(s);
    $("status").textContent = "updated " + new Date(s.now * 1000).toLocaleTimeString();
    timer = setTimeout(poll, POLL_MS);
  }

  // A server with keys and no key in this tab: the form first, not a refused request.
  async function start() {
    try {
      const resp = await fetch("/dashboard/session.json", { cache: "no-store" });
      const session = await resp.json();
      if (session.keys && !sessionStorage.getItem(KEY)) { showLogin(""); return; }
    } catch (e) { /* the poll reports an unreachable server */ }
    poll();
  }

  function selectTab(name) {
    document.querySelectorAll("#tabs button").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
    document.querySelectorAll(".panel").forEach((p) => p.classList.toggle("active", p.dataset.panel === name));
  }

  document.addEventListener("DOMContentLoaded", () => {
    document.querySelectorAll("#tabs button").forEach((b) => b.addEventListener("click", () => selectTab(b.dataset.tab)));
    $("login").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, $("login-key").value.trim());
      $("login-key").value = "";
      poll();
    });
    $("logout").addEventListener("click", () => { sessionStorage.removeItem(KEY); showLogin(""); });
    window.PKDashboard = { authHeaders, selectTab };
    start();
  });
})();
