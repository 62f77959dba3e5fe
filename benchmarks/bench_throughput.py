"""Many users at once through `pagedkv serve`: aggregate tokens/s, TTFT and ITL.

    .venv/bin/python benchmarks/bench_throughput.py [--streams 1,4,8,16] [--tokens 64]
        [--prompt-words 40] [--rounds 3] [--deterministic] [--src DIR]
        [--mode NAME=FLAGS ...] [--prefill-words 3000]

Starts `pagedkv serve` (bundled model, RAM tier only) on 127.0.0.1 and, for each
stream count N, has N clients stream a completion of `--tokens` tokens each, at
the same moment, from prompts of `--prompt-words` words (40 words: ~55 tokens,
a chat question) that no other request shares, so the figures are compute, not
cache hits. Per N, median of `--rounds` rounds:

- aggregate tokens/s: all generated tokens / wall time of the round;
- TTFT p50/p90 over every request of every round;
- ITL p50: the median gap between consecutive streamed tokens.

Then the cost of a newcomer: the TTFT of a new uncached 300-token request sent
while 7 streams decode, against the same request on the idle server.

Each server's start-up is timed too: from its launch to its first answer (the
`/health` check passing, then the first token of a one-token request).

`--prefill-words N` also times a cold prefill: three prompts of N words (3000
words: ~4K tokens) no request shares, `max_tokens` 1, prompt tokens/s from
each answer's usage over its TTFT, the median of the three.

`--mode NAME=FLAGS` (repeatable) serves pagedkv once per mode, one after the
other, with FLAGS added to `pagedkv serve`'s, e.g.
`--mode float32= --mode "bfloat16-compiled=--dtype bfloat16 --compile-decode"`
(default: one mode, `pagedkv`, with no extra flags).

`--deterministic` serves with `--deterministic`. `--src DIR` serves another
checkout's `src/` instead (a worktree of an older commit, say): run the two
one after the other to compare them. Only one server runs at a time: a second,
idle server's threads were seen to slow the measured one.

`--peer-cmd CMD` measures another OpenAI-compatible server in the same run,
after pagedkv: CMD starts it on `{port}` and must answer `GET /health`;
`--peer-model` is the `model` its requests name. A peer gets no `ignore_eos`,
so its tokens are counted from the usage of each stream (`stream_options`),
and its rounds are rated by the tokens it really generated. For transformers'
own server, which needs `accelerate` (`pip install --target DIR --no-deps
accelerate`), on one command line:

    --peer-name "transformers serve"
    --peer-model ~/.cache/pagedkv/models/smollm2-135m
    --peer-cmd "env PYTHONPATH=DIR HF_HUB_OFFLINE=1 .venv/bin/transformers serve
        --continuous-batching --host 127.0.0.1 --port {port}
        ~/.cache/pagedkv/models/smollm2-135m"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# A server's start-up may include compiling its decode step (`--compile-decode`).
START_TIMEOUT_S = 900

WORDS = (
    "harbor",
    "lantern",
    "river",
    "copper",
    "meadow",
    "quiet",
    "signal",
    "winter",
    "paper",
    "garden",
    "engine",
    "silver",
    "orchard",
    "thunder",
    "window",
    "candle",
    "marble",
    "compass",
    "feather",
    "valley",
)


def prompt_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    body: dict[str, object]  # what every request adds: `ignore_eos` for pagedkv, a peer's model
    seeds: list[int] = field(default_factory=list)
    started: float = 0.0  # time.perf_counter() at launch
    ready_s: float = 0.0  # launch to `/health` passing


def start_pagedkv(name: str, src: str | None, extra: list[str]) -> Server:
    port = free_port()
    env = os.environ.copy()
    if src:
        env["PYTHONPATH"] = src
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port)]
    cmd += ["--no-ssd-cache", "--log-level", "warning", *extra]
    return wait_for(name, cmd, env, port, {"ignore_eos": True})


def start_peer(name: str, command: str, model: str | None) -> Server:
    port = free_port()
    cmd = [os.path.expanduser(a) for a in shlex.split(command.format(port=port))]
    return wait_for(name, cmd, os.environ.copy(), port, {"model": model} if model else {})


def wait_for(
    name: str, cmd: list[str], env: dict[str, str], port: int, body: dict[str, object]
) -> Server:
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server {name} did not start")
        time.sleep(0.1)
    return Server(name, proc, url, body, started=started, ready_s=time.perf_counter() - started)


@dataclass
class Stream:
    ttft: float = 0.0
    stamps: list[float] = field(default_factory=list)
    tokens: int = 0  # generated, from the usage the server reports


def stream_one(
    server: Server, text: str, tokens: int, out: Stream, start: threading.Barrier
) -> None:
    body = {
        "prompt": text,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **server.body,
    }
    start.wait()
    t0 = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out.tokens = int(chunk["usage"]["completion_tokens"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                if not out.stamps:
                    out.ttft = now - t0
                out.stamps.append(now)


def first_answer_s(server: Server) -> float:
    """Launch to the first token of the first request."""
    stream_one(server, prompt_text(_next_seed(server), 8), 1, Stream(), threading.Barrier(1))
    return time.perf_counter() - server.started


def prefill_rate(server: Server, words: int, runs: int = 3) -> float:
    """Cold prompt tokens/s: prompts of `words` words no request shares, one token each,
    prompt tokens (from the usage) over TTFT; the median of `runs`."""
    rates = []
    for _ in range(runs):
        text = prompt_text(_next_seed(server), words)
        body = {"prompt": text, "max_tokens": 1, "temperature": 0, **server.body}
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        rates.append(int(r.json()["usage"]["prompt_tokens"]) / (time.perf_counter() - t0))
    return statistics.median(rates)


def round_of(server: Server, n: int, tokens: int, words: int) -> tuple[float, list[Stream]]:
    """N streams at once; (wall time, the streams)."""
    streams = [Stream() for _ in range(n)]
    barrier = threading.Barrier(n + 1)
    texts = [prompt_text(_next_seed(server), words) for _ in range(n)]
    threads = [
        threading.Thread(target=stream_one, args=(server, t, tokens, s, barrier))
        for t, s in zip(texts, streams, strict=True)
    ]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, streams


def _next_seed(server: Server) -> int:
    """A prompt this server has not seen; every server gets the same sequence."""
    server.seeds.append(len(server.seeds) + 1)
    return server.seeds[-1]


def newcomer_ttft(server: Server, busy: int, words: int = 220) -> float:
    """TTFT of a new uncached request of ~300 tokens while `busy` streams decode."""
    background: list[Stream] = [Stream() for _ in range(busy)]
    barrier = threading.Barrier(busy + 1)
    threads = [
        threading.Thread(
            target=stream_one,
            args=(server, prompt_text(_next_seed(server), 40), 400, s, barrier),
        )
        for s in background
    ]
    for t in threads:
        t.start()
    barrier.wait()
    if busy:
        while any(len(s.stamps) < 5 for s in background):  # every stream is decoding
            time.sleep(0.01)
    probe = Stream()
    stream_one(server, prompt_text(_next_seed(server), words), 2, probe, threading.Barrier(1))
    for t in threads:
        t.join()
    return probe.ttft


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


Rows = dict[int, dict[str, float]]


@dataclass
class Result:
    rows: Rows
    newcomer: tuple[float, float]  # TTFT idle, while 7 streams decode
    ready_s: float  # launch to /health
    first_answer_s: float  # launch to the first token
    prefill_tok_s: float | None  # cold prefill (`--prefill-words`)


def measure(server: Server, args: argparse.Namespace, counts: list[int]) -> Result:
    """Start-up; per stream count: tokens/s (median over rounds), TTFT, ITL; then the
    newcomer's TTFT and the cold prefill."""
    try:
        first = first_answer_s(server)
        round_of(server, 2, 4, args.prompt_words)  # warm up: first forwards of each shape
        rows: Rows = {}
        for n in counts:
            rates, got = [], []
            for _ in range(args.rounds):
                wall, streams = round_of(server, n, args.tokens, args.prompt_words)
                if any(not s.tokens for s in streams):
                    raise RuntimeError(f"{server.name} reported no usage for a stream")
                rates.append(sum(s.tokens for s in streams) / wall)
                got += streams
            gaps = [b - a for s in got for a, b in zip(s.stamps, s.stamps[1:], strict=False)]
            rows[n] = {
                "tok_s": statistics.median(rates),
                "ttft_p50": pct([s.ttft for s in got], 0.5),
                "ttft_p90": pct([s.ttft for s in got], 0.9),
                "itl_p50": statistics.median(gaps) if gaps else float("nan"),
                "tokens": statistics.mean(s.tokens for s in got),
            }
        idle = [newcomer_ttft(server, 0) for _ in range(args.newcomer_runs)]
        loaded = [newcomer_ttft(server, 7) for _ in range(args.newcomer_runs)]
        prefill = prefill_rate(server, args.prefill_words) if args.prefill_words else None
        newcomer = (statistics.median(idle), statistics.median(loaded))
        return Result(rows, newcomer, server.ready_s, first, prefill)
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)


def report(name: str, result: Result, counts: list[int]) -> None:
    """One server's figures, printed as soon as they are measured."""
    rows, newcomer = result.rows, result.newcomer
    one = rows[counts[0]]
    print(f"\n{name}")
    print(f"{'streams':>7} {'tok/s':>7} {'x 1st':>6} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'ITL p50':>8} {'x 1st':>6} {'tokens':>7}")  # fmt: skip
    for n in counts:
        r = rows[n]
        print(
            f"{n:>7} {r['tok_s']:>7.1f} {r['tok_s'] / one['tok_s']:>6.2f} "
            f"{r['ttft_p50'] * 1000:>7.0f}ms {r['ttft_p90'] * 1000:>7.0f}ms "
            f"{r['itl_p50'] * 1000:>6.0f}ms {r['itl_p50'] / one['itl_p50']:>6.2f} "
            f"{r['tokens']:>7.1f}"
        )
    idle, loaded = newcomer
    print(
        f"new 300-token request: TTFT {idle * 1000:.0f} ms idle, {loaded * 1000:.0f} ms "
        f"while 7 streams decode ({loaded / idle:.2f}x)"
    )
    print(
        f"start-up: /health after {result.ready_s:.1f} s, first answer after "
        f"{result.first_answer_s:.1f} s"
    )
    if result.prefill_tok_s is not None:
        print(f"cold prefill: {result.prefill_tok_s:.0f} prompt tokens/s")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--prompt-words", type=int, default=40)
    ap.add_argument("--src", default=None, help="serve another checkout's src/ instead")
    ap.add_argument("--newcomer-runs", type=int, default=3)
    ap.add_argument("--peer-cmd", default=None, help="start a peer server on {port}")
    ap.add_argument("--peer-model", default=None, help="the model field of the peer's requests")
    ap.add_argument("--peer-name", default="peer")
    ap.add_argument(
        "--mode", action="append", default=None, help="NAME=FLAGS: serve pagedkv with FLAGS"
    )
    ap.add_argument("--prefill-words", type=int, default=0, help="also time a cold prefill")
    args = ap.parse_args()
    if args.newcomer_runs < 1:
        ap.error("--newcomer-runs must be at least 1")
    counts = [int(c) for c in args.streams.split(",")]
    extra = ["--deterministic"] if args.deterministic else []
    src = str(Path(args.src).resolve()) if args.src else None
    modes = dict(m.split("=", 1) for m in args.mode or [f"{args.src or 'pagedkv'}="])
    mode = " (--deterministic)" if args.deterministic else ""
    print(
        f"bundled model, {args.prompt_words}-word prompts, {args.tokens} tokens per stream, "
        f"median of {args.rounds} rounds{mode}; tokens: the mean a stream generated",
        flush=True,
    )
    results: dict[str, Result] = {}  # each reported as soon as it is measured
    for name, flags in modes.items():
        server = start_pagedkv(name, src, extra + shlex.split(flags))
        results[name] = measure(server, args, counts)
        report(name, results[name], counts)
    if args.peer_cmd:
        peer = start_peer(args.peer_name, args.peer_cmd, args.peer_model)
        results[args.peer_name] = measure(peer, args, counts)
        report(args.peer_name, results[args.peer_name], counts)
    print()
    first = next(iter(modes))
    others = [n for n in results if n != first]
    for other in others:  # every mode and the peer against the first mode, then the peer
        ratios(results[other], results[first], f"{other} against {first}", counts)
    if args.peer_cmd:
        for name in modes:
            label = f"{name} against {args.peer_name}"
            ratios(results[name], results[args.peer_name], label, counts)
    return 0


def ratios(ours: Result, theirs: Result, label: str, counts: list[int]) -> None:
    """Tokens/s per stream count and cold prefill of `ours` over `theirs`."""
    parts = [f"{n}: {ours.rows[n]['tok_s'] / theirs.rows[n]['tok_s']:.2f}x" for n in counts]
    if ours.prefill_tok_s and theirs.prefill_tok_s:
        parts.append(f"prefill: {ours.prefill_tok_s / theirs.prefill_tok_s:.2f}x")
    print(f"{label}, tokens/s per stream count: {'  '.join(parts)}")


if __name__ == "__main__":
    sys.exit(main())
