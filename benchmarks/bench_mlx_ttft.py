"""Cached TTFT on MLX, pagedkv against mlx_lm.server, in one run: a controlled probe.

The workload bench (`bench_mlx_peers.py`) always runs mlx_lm.server first and
pagedkv second, and on the hosts measured the second half of a run was slower
than the first by as much as the difference between the servers. This probe
takes one server at a time in the order `--order` gives (run it both ways):
a 396-token chat (system rules plus a greeting; cold), then `--turns`
follow-ups sharing its system prompt, each with a new ~20-token user message,
streamed greedy with `max_tokens` 4. Prints each request's time to the first
content chunk, cached tokens and prompt tokens, and the medians.

    .venv/bin/python benchmarks/bench_mlx_ttft.py --order pagedkv-first
    .venv/bin/python benchmarks/bench_mlx_ttft.py --order mlx-first
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_mlx_peers as peers

from pagedkv.model.resolve import resolve_model

RULES = " ".join(f"rule {i}: keep the cache warm and answer briefly." for i in range(30))


def _model_id(url: str, model_dir: Path) -> str:
    """The id the server lists for the model (pagedkv: its name; mlx_lm: the path)."""
    try:
        ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError):
        return str(model_dir)
    return "smollm2-135m" if "smollm2-135m" in ids else str(model_dir)


def ttft(url: str, model_dir: Path, user: str) -> dict[str, Any]:
    """One streamed request: seconds to the first content chunk, and its usage."""
    body = {
        "model": _model_id(url, model_dir),
        "messages": [{"role": "system", "content": RULES}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            deltas = [c.get("delta") or {} for c in chunk.get("choices", [])]
            if first is None and any(d.get("content") for d in deltas):
                first = time.perf_counter() - t0
    if first is None:  # an empty answer: its end is its first token's time
        first = time.perf_counter() - t0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft_s": first, "cached": cached, "prompt": usage.get("prompt_tokens")}


def probe(server: peers.Server, model_dir: Path, turns: int) -> dict[str, Any]:
    with peers.running(server):
        cold = ttft(server.url, model_dir, "hello there")
        print(server.name, "cold", cold, flush=True)
        warm = []
        for i in range(turns):
            user = f"question number {i}: what is {i} plus {i}, and why?"
            got = ttft(server.url, model_dir, user)
            print(server.name, got, flush=True)
            warm.append(got["ttft_s"])
    return {"cold_s": cold["ttft_s"], "cached_median_s": statistics.median(warm)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--order", choices=("pagedkv-first", "mlx-first"), default="pagedkv-first")
    ap.add_argument("--turns", type=int, default=5)
    args = ap.parse_args()
    model_dir = resolve_model(args.model).directory.resolve()
    ssd = Path(tempfile.mkdtemp(prefix="pagedkv-mlx-ttft-"))
    servers = {
        "pagedkv": lambda: peers.pagedkv_server(model_dir, peers.free_port(), ssd),
        "mlx_lm.server": lambda: peers.mlx_server(model_dir, peers.free_port()),
    }
    order = list(servers) if args.order == "pagedkv-first" else list(reversed(servers))
    results = {name: probe(servers[name](), model_dir, args.turns) for name in order}
    for name, r in results.items():
        print(f"{name:14s} cold {r['cold_s']:.2f} s   cached median {r['cached_median_s']:.2f} s")
    ratio = results["pagedkv"]["cached_median_s"] / results["mlx_lm.server"]["cached_median_s"]
    print(f"pagedkv / mlx_lm.server, cached TTFT: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
