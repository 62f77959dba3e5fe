"""Run an engine in a separate process: `python engine_worker.py SPEC_JSON` prints results.

SPEC: {"model": dir, "cache": {CacheConfig kwargs}, "prompts": [[ids], ...],
       "max_tokens": n, "loras": {name: dir} (optional), "adapters": [name or null
       per prompt] (optional)}. Output: one JSON line per prompt with token_ids and
cached_tokens, then the cache stats.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from pagedkv import CacheConfig, Engine, SamplingParams


def main() -> None:
    spec = json.loads(sys.argv[1])
    engine = Engine.from_pretrained(spec["model"], config=CacheConfig(**spec["cache"]))
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    for name, directory in spec.get("loras", {}).items():
        engine.load_adapter(name, directory)
    adapters = spec.get("adapters", [None] * len(spec["prompts"]))
    for prompt, lora in zip(spec["prompts"], adapters, strict=True):
        r = engine.generate(prompt, params, lora=lora)
        print(
            json.dumps(
                {
                    "token_ids": r.token_ids,
                    "cached_tokens": r.cached_tokens,
                    "tier_hits": r.tier_hits,
                }
            ),
            flush=True,
        )
    stats = engine.cache_stats()
    engine.close()
    print(json.dumps({"stats": dataclasses.asdict(stats)}, default=str), flush=True)


if __name__ == "__main__":
    main()
