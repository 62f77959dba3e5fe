"""What the dashboard's live view costs the server: CPU per refresh of
`GET /v1/dashboard/state`, against the target of under 1% of one core at one refresh
per 2 s (under 20 ms of CPU per refresh).

    .venv/bin/python benchmarks/bench_dashboard.py [--model smollm2-135m] [--requests 60]
        [--polls 200] [--paced 15]

Starts `pagedkv serve` (RAM and a temporary SSD tier, no keys, loopback) in a
subprocess, sends `--requests` short chat requests (a few conversations, so there are
hits, misses, tenants and filled buckets), then reads the server process's CPU time
(user + system, psutil):
- idle: over 10 s with no request, the server's own background cost;
- back to back: `--polls` refreshes in a row, CPU per refresh after subtracting idle;
- paced: `--paced` refreshes at the page's own pace (one per 2 s), the share of one core
  above idle.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

URL_RE = re.compile(r"serving on (http://127\.0\.0\.1:\d+)")


def start(model: str, ssd: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", model, "--port", "0"]
    cmd += ["--ssd-cache-dir", ssd]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = URL_RE.search(log.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start:\n{log.read_text(errors='replace')[-3000:]}")


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--polls", type=int, default=200)
    ap.add_argument("--paced", type=int, default=15)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start(a.model, tmp + "/ssd", Path(tmp) / "server.log")
        try:
            server = psutil.Process(proc.pid)
            with httpx.Client(base_url=url, timeout=120) as http:
                system = "You are a terse assistant who answers about caches. " * 6
                for i in range(a.requests):
                    messages = [{"role": "system", "content": system}]
                    messages += [{"role": "user", "content": f"conversation {i % 6}, turn {i}"}]
                    body = {"messages": messages, "max_tokens": 4}
                    r = http.post("/v1/chat/completions", json=body)
                    r.raise_for_status()
                state = http.get("/v1/dashboard/state")
                state.raise_for_status()
                size = len(state.content)
                buckets = len(state.json()["traffic"]["buckets"])
                time.sleep(3)
                c0, t0 = cpu(server), time.monotonic()
                time.sleep(10)
                idle = (cpu(server) - c0) / (time.monotonic() - t0)
                c0, t0 = cpu(server), time.monotonic()
                for _ in range(a.polls):
                    http.get("/v1/dashboard/state").raise_for_status()
                elapsed = time.monotonic() - t0
                per_poll = (cpu(server) - c0 - idle * elapsed) / a.polls
                c0, t0 = cpu(server), time.monotonic()
                for i in range(a.paced):
                    http.get("/v1/dashboard/state").raise_for_status()
                    time.sleep(max(0.0, t0 + 2.0 * (i + 1) - time.monotonic()))
                elapsed = time.monotonic() - t0
                paced = (cpu(server) - c0) / elapsed - idle
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"model {a.model}; state body {size} bytes, {buckets} buckets")
    print(f"idle server:              {idle * 100:.2f}% of a core")
    print(f"back to back ({a.polls} refreshes): {per_poll * 1000:.2f} ms CPU per refresh")
    print(f"  at one refresh per 2 s: {per_poll / 2 * 100:.3f}% of a core (target < 1%)")
    print(f"paced ({a.paced} refreshes, one per 2 s): {paced * 100:.3f}% of a core above idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
