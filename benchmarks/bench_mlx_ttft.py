"""Cached TTFT on MLX, pagedkv against mlx_lm.server, in one run: a controlled probe.

The workload bench (`bench_mlx_peers.py`) always runs mlx_lm.server first and
pagedkv second, and on the hosts measured the second half of a run was slower
than the first by as much as the difference between the servers. This probe
takes one server at a time, `--rounds` rounds (default 2) alternating the order,
the first round's from `--order` (A B, B A, A B, ...): in each, a fresh server
gets a 396-token chat (`--rules` 30: system rules plus a greeting; cold), then
`--turns` follow-ups sharing its system prompt, each with a new ~20-token user
message, streamed greedy with `max_tokens` 4. Prints each request's time to the
first content chunk, cached tokens and prompt tokens; then, per round, each
follow-up's TTFT next to the cached tokens each server reported
(`usage.prompt_tokens_details.cached_tokens`) and the ratio pagedkv/mlx_lm, the
round's median ratio and the ratio of its medians, and the median ratio over
every round. Where both servers cached (so recomputed) the same tokens on a
follow-up, its TTFT difference is the compute's, not the reuse's.

    .venv/bin/python benchmarks/bench_mlx_ttft.py --order pagedkv-first --rounds 2
    .venv/bin/python benchmarks/bench_mlx_ttft.py --rounds 1 --turns 2 --rules 5   # smoke
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


def rules(count: int) -> str:
    """The shared system prompt: `count` rules (30: the 396-token chat)."""
    return " ".join(f"rule {i}: keep the cache warm and answer briefly." for i in range(count))


def _model_id(url: str, model_dir: Path) -> str:
    """The id the server lists for the model (pagedkv: its name; mlx_lm: the path)."""
    try:
        ids = [m["id"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError):
        return str(model_dir)
    return "smollm2-135m" if "smollm2-135m" in ids else str(model_dir)


def ttft(url: str, model_dir: Path, system: str, user: str) -> dict[str, Any]:
    """One streamed request: seconds to the first content chunk, and its usage."""
    body = {
        "model": _model_id(url, model_dir),
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
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


def probe(server: peers.Server, model_dir: Path, turns: int, system: str) -> dict[str, Any]:
    with peers.running(server):
        cold = ttft(server.url, model_dir, system, "hello there")
        print(server.name, "cold", cold, flush=True)
        followups = []
        for i in range(turns):
            user = f"question number {i}: what is {i} plus {i}, and why?"
            got = ttft(server.url, model_dir, system, user)
            print(server.name, got, flush=True)
            followups.append(got)
    warm = [got["ttft_s"] for got in followups]
    return {
        "cold_s": cold["ttft_s"],
        "cached_median_s": statistics.median(warm),
        "followups": followups,
    }


def _tokens(got: dict[str, Any]) -> str:
    """`cached/prompt` tokens as the server reported them ('?' where it did not)."""
    cached, prompt = got["cached"], got["prompt"]
    return f"{'?' if cached is None else cached}/{'?' if prompt is None else prompt}"


def compare(results: dict[str, dict[str, Any]]) -> list[float]:
    """Print each follow-up of one round side by side; its pagedkv/mlx_lm TTFT ratios."""
    ours, theirs = results["pagedkv"]["followups"], results["mlx_lm.server"]["followups"]
    ratios = []
    print(
        f"{'follow-up':>9s}  {'pagedkv s':>9s} {'cached/prompt':>13s}  "
        f"{'mlx_lm s':>9s} {'cached/prompt':>13s}  ratio  same recompute"
    )
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        ratio = a["ttft_s"] / b["ttft_s"]
        ratios.append(ratio)
        same = a["cached"] is not None and (a["cached"], a["prompt"]) == (b["cached"], b["prompt"])
        print(
            f"{i:>9d}  {a['ttft_s']:>9.2f} {_tokens(a):>13s}  {b['ttft_s']:>9.2f} "
            f"{_tokens(b):>13s}  {ratio:.2f}x  {'yes' if same else 'NO'}"
        )
    return ratios


def run_round(order: list[str], model_dir: Path, args: argparse.Namespace) -> list[float]:
    """Each server in `order`, fresh (pagedkv on an empty SSD directory); the ratios."""
    system = rules(args.rules)
    results = {}
    for name in order:
        if name == "pagedkv":
            with tempfile.TemporaryDirectory(prefix="pagedkv-mlx-ttft-") as ssd:
                server = peers.pagedkv_server(model_dir, peers.free_port(), Path(ssd))
                results[name] = probe(server, model_dir, args.turns, system)
        else:
            server = peers.mlx_server(model_dir, peers.free_port())
            results[name] = probe(server, model_dir, args.turns, system)
    for name, r in results.items():
        print(f"{name:14s} cold {r['cold_s']:.2f} s   cached median {r['cached_median_s']:.2f} s")
    ratio = results["pagedkv"]["cached_median_s"] / results["mlx_lm.server"]["cached_median_s"]
    print(f"pagedkv / mlx_lm.server, cached TTFT: {ratio:.2f}x")
    ratios = compare(results)
    print(f"median follow-up ratio this round: {statistics.median(ratios):.2f}x", flush=True)
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--order",
        choices=("pagedkv-first", "mlx-first"),
        default="pagedkv-first",
        help="the first round's order; each later round reverses the one before",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5, help="follow-ups after the cold chat")
    ap.add_argument(
        "--rules",
        type=int,
        default=30,
        help="rules in the shared system prompt (30: a 396-token chat)",
    )
    args = ap.parse_args()
    if args.rounds < 1 or args.turns < 1 or args.rules < 1:
        ap.error("--rounds, --turns and --rules take 1 or more")
    model_dir = resolve_model(args.model).directory.resolve()
    order = ["pagedkv", "mlx_lm.server"]
    if args.order == "mlx-first":
        order.reverse()
    every: list[float] = []
    for i in range(args.rounds):
        print(f"== round {i + 1} of {args.rounds}: {' then '.join(order)}", flush=True)
        every += run_round(order, model_dir, args)
        order.reverse()
    print(f"median follow-up ratio over {args.rounds} round(s): {statistics.median(every):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
