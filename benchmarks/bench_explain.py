"""Time of `Engine.explain` (what POST /v1/cache/explain runs) for a 32K-token prompt on
the bundled model, with the tiers `pagedkv serve` has by default (RAM and SSD).

    .venv/bin/python benchmarks/bench_explain.py [--tokens 32768] [--cached 4096] [--repeats 20]

The bundled model's context is 8K, so a 32K prompt can never be cached whole: the
first `--cached` tokens are (one real generation), the rest is looked up in RAM,
then in the SSD index, block by block. Cases: "prefix" (the cached 4K found in
RAM, the 28K after it asked of the SSD index; its miss is "new": no prompt went
further), "new" (another cache_salt: nothing to find), "evicted" (after a
clear). Every case hashes all 32K tokens; explain never runs the model.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time


def main() -> None:
    from pagedkv import CacheConfig, Engine, SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--cached", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine.from_pretrained(config=CacheConfig(ssd_cache_dir=tmp))
        rng = random.Random(0)
        prompt = [rng.randrange(100, engine.vocab_size - 100) for _ in range(a.tokens)]
        t0 = time.perf_counter()
        engine.generate(prompt[: a.cached], SamplingParams(max_tokens=1, temperature=0.0))
        print(f"cached the first {a.cached} tokens in {time.perf_counter() - t0:.1f} s")
        assert engine.prefix is not None
        engine.prefix.lower.flush(30.0)

        def timed(label: str, salt: str | None) -> None:
            times = []
            for _ in range(a.repeats):
                t = time.perf_counter()
                exp = engine.explain(prompt, cache_salt=salt)
                times.append((time.perf_counter() - t) * 1000)
            times.sort()
            miss = exp.miss
            print(
                f"{label:9s} median {statistics.median(times):6.1f} ms  "
                f"p90 {times[int(0.9 * (len(times) - 1))]:6.1f} ms  max {times[-1]:6.1f} ms  "
                f"cached {exp.cached_tokens}/{exp.prompt_tokens} tiers {exp.tiers}  "
                f"miss {None if miss is None else (miss.token_index, miss.reason)}"
            )

        timed("prefix", None)
        timed("new", "another-tenant")
        engine.clear_cache()
        timed("evicted", None)
        engine.close()


if __name__ == "__main__":
    main()
