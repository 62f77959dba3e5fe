// The chat tab: a plain conversation with the served model through
// POST /v1/chat/completions; each reply shows how many prompt tokens came from the cache
// and from which tier (GET /v1/dashboard/requests/{x-request-id}).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  let messages = [];

  function turn(role, text) {
    const d = document.createElement("div");
    d.className = "turn " + role;
    d.textContent = text;
    $("chat-log").appendChild(d);
    return d;
  }

  function cacheLine(target, usage, counts) {
    const line = document.createElement("div");
    line.className = "cache";
    const prompt = usage.prompt_tokens, cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    let tiers = "";
    if (counts) {
      const parts = Object.entries(counts.cached).filter(([, n]) => n > 0).map(([t, n]) => t + " " + n);
      tiers = parts.length ? " (" + parts.join(", ") + ")" : "";
    }
    line.textContent = "prompt " + prompt + " tokens: " + cached + " from the cache" + tiers + ", " +
      (prompt - cached) + " computed; " + usage.completion_tokens + " generated";
    line.dataset.prompt = String(prompt);
    line.dataset.cached = String(cached);
    if (counts) for (const [t, n] of Object.entries(counts.cached)) line.dataset["tier" + t] = String(n);
    target.appendChild(line);
  }

  async function send(ev) {
    ev.preventDefault();
    const text = $("chat-input").value;
    if (!text.trim()) return;
    $("chat-input").value = "";
    $("chat-send").disabled = true;
    messages.push({ role: "user", content: text });
    turn("user", text);
    const headers = Object.assign({ "Content-Type": "application/json" }, window.PKDashboard.authHeaders());
    try {
      const resp = await fetch("/v1/chat/completions", {
        method: "POST", headers,
        body: JSON.stringify({ messages, max_tokens: Number($("chat-max").value) || 64 }),
      });
      const body = await resp.json();
      if (!resp.ok) {
        messages.pop();
        turn("assistant", "error: " + (body.error ? body.error.message : resp.status)).classList.add("error");
        return;
      }
      const reply = body.choices[0].message.content || "";
      messages.push({ role: "assistant", content: reply });
      const d = turn("assistant", reply);
      let counts = null;
      const id = resp.headers.get("x-request-id");
      if (id) {
        const r = await fetch("/v1/dashboard/requests/" + encodeURIComponent(id), { headers: window.PKDashboard.authHeaders() });
        if (r.ok) counts = await r.json();
      }
      cacheLine(d, body.usage, counts);
    } finally {
      $("chat-send").disabled = false;
    }
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("chat-form").addEventListener("submit", send);
    $("chat-reset").addEventListener("click", () => { messages = []; $("chat-log").replaceChildren(); });
  });
})();
