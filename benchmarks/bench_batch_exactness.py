"""How often batching changes a greedy answer: each request alone, then eight at once.

    .venv/bin/python benchmarks/bench_batch_exactness.py [--requests 32] [--tokens 64]
        [--concurrency 8] [--deterministic]

Bundled model, prefix caching off (so only batching differs), prompts of ~55
tokens from a seeded word list. Every request runs alone first, then all of
them again with `--concurrency` at once; the script counts requests whose
greedy tokens differ, and for those the position of the first difference.
With `--deterministic` the count must be 0.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.engine import SchedulerConfig

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--deterministic", action="store_true")
    args = ap.parse_args()
    engine = Engine.from_pretrained(
        "smollm2-135m",
        config=CacheConfig(enable_prefix_caching=False),
        scheduling=SchedulerConfig(deterministic=args.deterministic),
    )
    rng = random.Random(0)
    prompts = [
        " ".join(rng.choice(WORDS) for _ in range(40)) + f" {i}" for i in range(args.requests)
    ]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    t0 = time.perf_counter()
    alone = [engine.generate(p, params).token_ids for p in prompts]
    t_alone = time.perf_counter() - t0
    together: list[list[int]] = [[] for _ in prompts]
    gate = threading.Semaphore(args.concurrency)

    def run(i: int) -> None:
        with gate:
            together[i] = engine.generate(prompts[i], params).token_ids

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_together = time.perf_counter() - t0
    engine.close()
    firsts = [
        next(j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b)
        for x, y in zip(alone, together, strict=True)
        if x != y
    ]
    mode = "deterministic" if args.deterministic else "default"
    print(
        f"{mode} mode: {len(firsts)} of {len(prompts)} greedy answers ({args.tokens} tokens) "
        f"differ between alone and {args.concurrency} at once"
        + (f"; first differing token at positions {sorted(firsts)}" if firsts else "")
    )
    print(f"wall: {t_alone:.1f} s alone, {t_together:.1f} s batched")
    return 1 if args.deterministic and firsts else 0


if __name__ == "__main__":
    sys.exit(main())
