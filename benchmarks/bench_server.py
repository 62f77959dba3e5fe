"""Single-stream tokens/s through `pagedkv serve` vs the engine called directly.

    .venv/bin/python benchmarks/bench_server.py [--model smollm2-135m] [--tokens 128] [--runs 5]

The server runs as a subprocess on 127.0.0.1 (as users run it) and is driven by
the official `openai` client with streaming; the direct path streams from an
`Engine` in this process. Runs alternate between the two so that both see the
same machine. Decode rate = (tokens - 1) / (last token time - first token time);
the server's overhead is 1 - server rate / direct rate.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import openai

from pagedkv import CacheConfig, Engine, SamplingParams

PROMPT = "Write a long story about a lighthouse keeper who collects old maps."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def direct(engine: Engine, tokens: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    stamps = []
    for event in engine.chat_stream([{"role": "user", "content": PROMPT}], params):
        if event.token_ids:
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps) / (stamps[-1] - start)


def served(client: openai.OpenAI, model: str, tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    stamps = []
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), len(stamps) / (stamps[-1] - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "serve",
            "--model",
            args.model,
            "--port",
            str(port),
            "--no-ssd-cache",
            "--no-prefix-cache",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ.copy(),
    )
    engine = Engine.from_pretrained(args.model, config=CacheConfig(enable_prefix_caching=False))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.5)
        served(client, model, 8)  # warm both paths
        direct(engine, 8)
        d_rates, s_rates, d_e2e, s_e2e = [], [], [], []
        for _ in range(args.runs):
            rate, e2e = direct(engine, args.tokens)
            d_rates.append(rate)
            d_e2e.append(e2e)
            rate, e2e = served(client, model, args.tokens)
            s_rates.append(rate)
            s_e2e.append(e2e)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        engine.close()
    d, s = statistics.median(d_rates), statistics.median(s_rates)
    print(
        f"model {args.model}, {args.tokens} tokens per stream, median of {args.runs} "
        "alternating runs"
    )
    print(f"{'path':8} {'decode tok/s':>13} {'end-to-end tok/s':>17}")
    print(f"{'engine':8} {d:>13.1f} {statistics.median(d_e2e):>17.1f}")
    print(f"{'server':8} {s:>13.1f} {statistics.median(s_e2e):>17.1f}")
    print(
        f"server overhead: {100 * (1 - s / d):.1f}% of decode tokens/s "
        f"({100 * (1 - statistics.median(s_e2e) / statistics.median(d_e2e)):.1f}% end to end)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
