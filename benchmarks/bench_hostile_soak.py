"""The hostile soak: two well-behaved keys beside every hostile shape of docs/security.md.

A real `pagedkv serve` on 127.0.0.1 with three API keys and an admin key runs
two phases of `--seconds` each:

1. quiet: keys `alpha` and `beta` each send short greedy chats, one at a time;
2. hostile: the same, while key `mallory` (and clients without a key) send the
   shapes the security review found: n > 1 with seeds near 2^64, explain walks
   over another end user's message under one shared key, half-sent requests
   holding every connection, count_tokens and explain floods with tool
   definitions up to the body limit, huge `response_format` and `metadata`,
   JSON nested past the depth cap, `tool_calls` arguments of 50,000 `[`, scrapes
   of /metrics, /docs and /openapi.json without a key, and requests whose `n`
   fills the key's share.

Throughout, /health is asked every 0.5 s and the server's RSS sampled. At the end
it checks, and prints each figure: 0 sequences running or waiting and 0 KV
reserved once the traffic stopped; no 5xx answer to anyone; explain never
returned the other user's words; the normal keys' median latency within 3x of
the quiet phase's; /health 200 every time; peak RSS within the bound of
docs/security.md ("Memory"). Exit status 0 when every check holds.

    .venv/bin/python benchmarks/bench_hostile_soak.py --seconds 300   # the 10-minute soak
    .venv/bin/python benchmarks/bench_hostile_soak.py --model DIR --seconds 25

tests/server/test_hostile_soak.py runs the same soak for a minute on a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

KEYS = {"alpha": "alpha-key", "beta": "beta-key", "mallory": "mallory-key", "admin": "root-key"}
URL_RE = re.compile(r"serving on (http://127\.0\.0\.1:\d+)")
MAX_CONNECTIONS = 64
MAX_BODY_BYTES = 2 * 1024 * 1024
NORMAL_ADDRESS = "127.0.0.1"  # the two normal keys' host
ATTACKER_ADDRESS = "127.0.0.3"  # mallory's requests
HOG_ADDRESS = "127.0.0.2"  # the half-sent requests
PROBE_ADDRESS = "127.0.0.4"  # the orchestrator asking /health
SECRET_WORDS = "the vault code is periwinkle elephant seventeen cobalt staircase"
RSS_SLACK_BYTES = 256 * 2**20  # allocator and interpreter slack on top of the budgets
REQUEST_MEMORY_FACTOR = 4  # a body's bytes, its parse in the limits check and FastAPI's


@dataclass
class Tally:
    """What every client saw; threads add under the lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    latencies: dict[str, list[float]] = field(default_factory=dict)
    health: list[tuple[float, int | str]] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    # Cores each process kept busy per phase (CPU seconds over wall seconds): the
    # clients run on this host too, so what they burn the server cannot use.
    cores: dict[str, tuple[float, float]] = field(default_factory=dict)

    def status(self, who: str, code: int) -> None:
        with self.lock:
            self.statuses[(who, code)] += 1

    def errors(self) -> dict[str, int]:
        """500s from anyone, and anything but 200 for the normal keys."""
        return {
            f"{who} {code}": n
            for (who, code), n in self.statuses.items()
            if code == 500 or (who in ("alpha", "beta") and code != 200)
        }


def start_server(
    model: str, workdir: Path, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str, Path]:
    log_path = workdir / "server.log"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PAGEDKV_API_KEY": ",".join(KEYS[k] for k in ("alpha", "beta", "mallory")),
        "PAGEDKV_ADMIN_KEY": KEYS["admin"],
    }
    cmd = [
        sys.executable,
        "-c",
        "import sys; from pagedkv.cli import main; sys.exit(main())",
        "serve",
        "--model",
        model,
        "--port",
        "0",
        "--ssd-cache-dir",
        str(workdir / "kv"),
        "--ssd-cache",
        "256MiB",
        "--ram-cache",
        "128MiB",
        "--kv-budget",
        "256MiB",
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--receive-timeout",
        "5",
        *extra,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        match = URL_RE.search(log_path.read_text(errors="replace"))
        if match:
            return proc, match.group(1), log_path
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the server did not start:\n{log_path.read_text(errors='replace')[-4000:]}")


def client(url: str, key: str | None, source: str = NORMAL_ADDRESS) -> httpx.Client:
    """A client from `source`, one of the loopback addresses that stand for hosts."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=url, headers=headers, timeout=60.0, transport=transport)


def normal_traffic(url: str, who: str, stop: threading.Event, tally: Tally, phase: str) -> None:
    """One chat at a time: a shared system prompt and a short new question."""
    rng = random.Random(who)
    system = f"You are {who}'s helpful assistant. Answer briefly. " * 4
    with client(url, KEYS[who]) as http:
        while not stop.is_set():
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Question {rng.randrange(10**6)}: why?"},
                ],
                "max_tokens": 8,
                "temperature": 0,
            }
            start = time.perf_counter()
            try:
                r = http.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                tally.status(who, 599)
                continue
            elapsed = time.perf_counter() - start
            tally.status(who, r.status_code)
            if r.status_code == 200:
                with tally.lock:
                    tally.latencies.setdefault(phase, []).append(elapsed)


def watch(url: str, pid: int, stop: threading.Event, tally: Tally) -> None:
    """/health every 0.5 s (2 s to answer) and the server's RSS."""
    proc = psutil.Process(pid)
    transport = httpx.HTTPTransport(local_address=PROBE_ADDRESS)
    with httpx.Client(base_url=url, timeout=2.0, transport=transport) as http:
        while not stop.wait(0.5):
            try:
                code: int | str = http.get("/health").status_code
            except httpx.HTTPError as exc:
                code = type(exc).__name__
            with tally.lock:
                tally.health.append((time.monotonic(), code))
                tally.rss.append(proc.memory_info().rss)


DEEP = "__deep__"  # stands for JSON nested 900 levels deep, spliced in after dumps


def nested_json(levels: int) -> str:
    """A JSON schema `levels` objects deep, as text (json.dumps itself recurses)."""
    half = levels // 2
    return '{"type":"object","properties":{"x":' * half + '{"type":"string"}' + "}}" * half


def hostile_shapes(
    url: str, model: str, stop: threading.Event, tally: Tally
) -> dict[str, Callable[[], None]]:
    """One loop per shape, by name, each sending one request at a time until `stop`."""
    huge_tool = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d" * (MAX_BODY_BYTES - 4096),
            "parameters": {"type": "object"},
        },
    }
    deep = DEEP
    chat_base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    shapes: list[tuple[str, str, dict[str, Any]]] = [
        ("seed", "/v1/chat/completions",
         {**chat_base, "n": 2, "temperature": 1.0, "seed": 2**64 - 1}),
        ("seed_n3", "/v1/chat/completions",
         {**chat_base, "n": 3, "temperature": 0.7, "seed": 2**64 - 2}),
        ("count_tokens", "/v1/messages/count_tokens",
         {"model": model, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{"name": "f", "description": "d" * (MAX_BODY_BYTES - 4096),
                     "input_schema": {"type": "object"}}]}),
        ("explain_tools", "/v1/cache/explain", {**chat_base, "tools": [huge_tool]}),
        ("response_format", "/v1/chat/completions",
         {**chat_base, "response_format": {"type": "json_schema",
                                          "json_schema": {"name": "x", "schema": {
                                              f"k{i}": "v" * 64 for i in range(20000)}}}}),
        ("metadata", "/v1/messages",
         {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
          "metadata": {f"k{i}": "v" * 64 for i in range(20000)}}),
        ("deep_tools", "/v1/chat/completions",
         {**chat_base, "tools": [{"type": "function",
                                  "function": {"name": "f", "parameters": deep}}]}),
        ("deep_schema", "/v1/messages",
         {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{"name": "f", "input_schema": deep}]}),
        ("deep_count", "/v1/messages/count_tokens",
         {"model": model, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{"name": "f", "input_schema": deep}]}),
        ("deep_tool_use", "/v1/messages",
         {"model": model, "max_tokens": 4, "messages": [
             {"role": "user", "content": "hi"},
             {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "t1", "name": "f", "input": deep}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}),
        ("brackets", "/v1/chat/completions",
         {"max_tokens": 4, "messages": [
             {"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "f", "arguments": "[" * 50_000}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
        ("share", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": "tell me a story " * 40}],
          "max_tokens": 32, "n": 8, "temperature": 0.9}),
    ]  # fmt: skip
    deep_text = nested_json(900)
    payloads = [
        (name, path, json.dumps(body).replace(f'"{DEEP}"', deep_text).encode())
        for name, path, body in shapes
    ]

    def sender(name: str, path: str, payload: bytes) -> Callable[[], None]:
        def run() -> None:
            with client(url, KEYS["mallory"], ATTACKER_ADDRESS) as http:
                while not stop.is_set():
                    try:
                        r = http.post(
                            path, content=payload, headers={"Content-Type": "application/json"}
                        )
                        tally.status(f"mallory:{name}", r.status_code)
                    except httpx.HTTPError:
                        tally.status(f"mallory:{name}", 0)
                    stop.wait(0.1)

        return run

    loops = {name: sender(name, path, payload) for name, path, payload in payloads}
    loops["explain_walk"] = lambda: explain_walk(url, stop, tally)
    loops["scrape"] = lambda: scrape(url, stop, tally)
    loops["hog"] = lambda: hog_connections(url, stop, tally)
    return loops


def explain_walk(url: str, stop: threading.Event, tally: Tally) -> None:
    """Two end users behind one application key: the victim's message is cached, the
    attacker asks explain about prompts that share its start and looks for its words."""
    victim = [{"role": "user", "content": SECRET_WORDS}]
    secret_tail = SECRET_WORDS.split()[4:]  # words no answer has of its own
    with client(url, KEYS["mallory"], ATTACKER_ADDRESS) as http:
        http.post("/v1/chat/completions", json={"messages": victim, "max_tokens": 2})
        guess = "the vault code is"
        while not stop.is_set():
            r = http.post(
                "/v1/cache/explain", json={"messages": [{"role": "user", "content": guess}]}
            )
            tally.status("mallory:explain_walk", r.status_code)
            if r.status_code == 200:
                leaked = [w for w in secret_tail if w in r.text]
                if leaked:
                    with tally.lock:
                        tally.leaks.append(f"explain answered {leaked}: {r.text[:300]}")
            stop.wait(0.1)


def scrape(url: str, stop: threading.Event, tally: Tally) -> None:
    with client(url, None, ATTACKER_ADDRESS) as http:
        while not stop.is_set():
            for path in ("/metrics", "/docs", "/openapi.json"):
                try:
                    tally.status(f"anon:{path}", http.get(path).status_code)
                except httpx.HTTPError:
                    tally.status(f"anon:{path}", 0)
            stop.wait(0.2)


def hog_connections(url: str, stop: threading.Event, tally: Tally) -> None:
    """Keep MAX_CONNECTIONS half-sent requests open, reopening those the server drops."""
    host, port = url.removeprefix("http://").split(":")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n{"
    socks: list[socket.socket] = []
    try:
        while not stop.is_set():
            alive = []
            for s in socks:
                try:
                    s.send(b" ")
                    alive.append(s)
                except OSError:
                    s.close()
            socks = alive
            while len(socks) < MAX_CONNECTIONS and not stop.is_set():
                try:
                    s = socket.create_connection(
                        (host, int(port)), timeout=1, source_address=(HOG_ADDRESS, 0)
                    )
                    s.sendall(head)
                    socks.append(s)
                except OSError:
                    break
            tally.status("anon:hog_open", len(socks))  # a count, for the report
            stop.wait(0.5)
    finally:
        for s in socks:
            s.close()


def admin_figures(url: str) -> dict[str, Any]:
    with client(url, KEYS["admin"]) as http:
        r = http.get("/v1/cache/stats")
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body


def settle(url: str, timeout: float) -> dict[str, Any]:
    """The admin's figures once nothing is pending, runs or waits (or after `timeout`),
    with /health's count of pending requests as `pending`."""
    deadline = time.monotonic() + timeout
    while True:
        figures = admin_figures(url)
        with client(url, None, PROBE_ADDRESS) as http:
            figures["pending"] = http.get("/health").json()["active_requests"]
        sched = figures.get("scheduling") or {}
        idle = not figures["pending"] and not sched.get("running") and not sched.get("waiting")
        if (idle and not sched.get("kv_reserved_bytes")) or time.monotonic() > deadline:
            return figures
        time.sleep(0.5)


def run_phase(
    url: str, model: str, pid: int, seconds: float, shapes: set[str] | None, tally: Tally
) -> None:
    """Normal traffic for `seconds`, beside the hostile `shapes` (all when None)."""
    stop = threading.Event()
    phase = "hostile" if shapes is None or shapes else "quiet"
    loops: list[Callable[[], None]] = [
        lambda: normal_traffic(url, "alpha", stop, tally, phase),
        lambda: normal_traffic(url, "beta", stop, tally, phase),
        lambda: watch(url, pid, stop, tally),
    ]
    hostile = hostile_shapes(url, model, stop, tally)
    loops += [fn for name, fn in hostile.items() if shapes is None or name in shapes]
    threads = [threading.Thread(target=fn, daemon=True) for fn in loops]
    server, me = psutil.Process(pid), psutil.Process()
    busy = [sum(p.cpu_times()[:2]) for p in (server, me)]
    start = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    wall = time.monotonic() - start
    server_cores, client_cores = (
        (sum(p.cpu_times()[:2]) - b) / wall for p, b in zip((server, me), busy, strict=True)
    )
    tally.cores[phase] = (server_cores, client_cores)
    stop.set()
    for t in threads:
        t.join(120)


def rss_bound(figures: dict[str, Any], idle_rss: int) -> int:
    """docs/security.md, "Memory": the idle server, its RAM tier and KV budget, and the
    bodies the connection cap lets in at once, each held a few times over while parsed."""
    ram = figures["tiers"]["ram"]["capacity_bytes"]
    kv = figures["scheduling"]["kv_budget_bytes"]
    return (
        idle_rss
        + ram
        + kv
        + REQUEST_MEMORY_FACTOR * MAX_CONNECTIONS * MAX_BODY_BYTES
        + RSS_SLACK_BYTES
    )


@dataclass
class Verdict:
    checks: dict[str, bool]
    lines: list[str]

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


def soak(
    model: str, seconds: float, extra: list[str] | None = None, shapes: set[str] | None = None
) -> Verdict:
    """Both phases against a fresh server; `shapes` limits the hostile ones (to find
    what costs the normal keys most), None for all."""
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="pagedkv-soak-") as tmp:
        proc, url, log_path = start_server(model, Path(tmp), extra or [])
        try:
            with client(url, KEYS["alpha"]) as http:  # warm up before anything is timed
                served = http.get("/v1/models").json()["data"][0]["id"]
                http.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                )
            idle_rss = psutil.Process(proc.pid).memory_info().rss
            run_phase(url, served, proc.pid, seconds, set(), tally)
            run_phase(url, served, proc.pid, seconds, shapes, tally)
            figures = settle(url, 60)
            log_text = log_path.read_text(errors="replace")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    sched = figures.get("scheduling", {})
    quiet = statistics.median(tally.latencies.get("quiet", [float("nan")]))
    loud = statistics.median(tally.latencies.get("hostile", [float("nan")]))
    bad_health = [code for _, code in tally.health if code != 200]
    peak = max(tally.rss, default=0)
    bound = rss_bound(figures, idle_rss) if "scheduling" in figures else 0
    checks = {
        "no request pending, running or waiting": not figures.get("pending")
        and not sched.get("running")
        and not sched.get("waiting"),
        "no KV reserved": sched.get("kv_reserved_bytes") == 0,
        "no 500, normal keys all 200": not tally.errors(),
        "explain leaked nothing": not tally.leaks,
        "normal p50 within 3x quiet": loud <= 3 * quiet,
        "/health 200 throughout": bool(tally.health) and not bad_health,
        "RSS within the bound": 0 < peak <= bound,
        "no traceback in the log": "Traceback" not in log_text,
        "/metrics, /docs, /openapi.json need a key": not any(
            who.startswith("anon:/") and code == 200 for (who, code) in tally.statuses
        ),
    }
    served = sum(
        n for (who, code), n in tally.statuses.items() if who in ("alpha", "beta") and code == 200
    )
    lines = [
        f"normal requests answered: {served}; p50 quiet {quiet * 1000:.0f} ms, "
        f"hostile {loud * 1000:.0f} ms ({loud / quiet:.2f}x)",
        f"after: {figures.get('pending')} pending; scheduling {sched}",
        *(
            f"{phase} phase: server busy {srv:.2f} cores, clients {cli:.2f} cores "
            f"(of {os.cpu_count()})"
            for phase, (srv, cli) in tally.cores.items()
        ),
        f"/health answers: {len(tally.health)}, not 200: {Counter(map(str, bad_health))}",
        f"RSS idle {idle_rss / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB, "
        f"bound {bound / 2**20:.0f} MiB",
        "statuses: "
        + ", ".join(
            f"{w} {c}: {n}"
            for (w, c), n in sorted(tally.statuses.items())
            if not w.endswith("hog_open")
        ),
        f"errors: {tally.errors()}",
        *tally.leaks[:3],
    ]
    lines += [f"{'ok  ' if ok else 'FAIL'} {name}" for name, ok in checks.items()]
    return Verdict(checks, lines)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m", help="model directory or the bundled model")
    p.add_argument("--seconds", type=float, default=300.0, help="length of each phase")
    p.add_argument("--shapes", help="only these hostile shapes, comma-separated (default all)")
    p.add_argument("serve_args", nargs="*", help="more `pagedkv serve` flags (after --)")
    a = p.parse_args()
    shapes = set(a.shapes.split(",")) if a.shapes else None
    verdict = soak(a.model, a.seconds, a.serve_args, shapes)
    print("\n".join(verdict.lines))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
