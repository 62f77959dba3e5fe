"""`pagedkv bench --workload flood`: does a leased agent prefix survive a flood?

One agent prefix (a system prompt of tool definitions, `prefix_tokens` long) is
sent with a lease (`cache.leases`, as `cache_control` or `prompt_cache_retention`
would ask), then hit a few times undisturbed; then unrelated traffic of
`multiple` times the RAM tier goes through; then the prefix comes back. Reported:
the cached tokens of that request against the prefix (target >= 0.98) and its
time to first token against the undisturbed hits' median (target <= 1.3x). The
same run without a lease, on a fresh engine with a fresh hash seed, reports what
survives without one (from RAM or a lower tier, as `tier_hits` says).

Prompts are token ids of text from the workloads' word list, cut to length, so
their sizes are exact whatever the tokenizer; nothing here is downloaded.
"""

from __future__ import annotations

import dataclasses
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.bench.workloads import _text, _tool_definitions
from pagedkv.cache.leases import LeaseRequest
from pagedkv.config import CacheConfig


@dataclass(frozen=True, slots=True)
class FloodShape:
    prefix_tokens: int  # the leased agent prefix
    ram_tokens: int  # the RAM tier, in tokens of KV
    flood_prompt_tokens: int  # each unrelated request
    question_tokens: int  # what follows the prefix in each of its requests
    multiple: int = 20  # the flood, in RAM tiers
    hits: int = 3  # undisturbed hits measured before the flood


# Sized so that the prefix takes a third of the RAM tier (under the default
# --max-leased-fraction of 0.5). full is the 10K-token prefix: 600K flood
# tokens, for an accelerator; quick prefills ~31K tokens per run, minutes on a CPU.
SHAPES = {
    "tiny": FloodShape(64, 192, 48, 8),
    "quick": FloodShape(512, 1536, 512, 32),
    "full": FloodShape(10240, 30720, 2048, 64),
}
TARGET_REUSE = 0.98
TARGET_TTFT_RATIO = 1.3


def _ids(engine: Any, rng: random.Random, n: int, tools: bool = False) -> list[int]:
    """`n` token ids of generated text (tool definitions when `tools`)."""
    ids: list[int] = []
    while len(ids) < n:
        text = _tool_definitions(rng, n) if tools else _text(rng, n)
        ids += engine.tokenize(text)
    return ids[:n]


def _run_once(
    adapter: Any, shape: FloodShape, config: CacheConfig, seed: int, lease: bool
) -> dict[str, Any]:
    from pagedkv.engine import Engine, SamplingParams

    rng = random.Random(f"pagedkv-bench:flood:{seed}")
    engine = Engine(adapter, config)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prefix = _ids(engine, rng, shape.prefix_tokens, tools=True)
        leases = [LeaseRequest(len(prefix), 3600.0)] if lease else []

        def ask(question: int) -> Any:
            q = _ids(engine, random.Random(f"flood-q:{seed}:{question}"), shape.question_tokens)
            return _generate(engine, prefix + q, params, leases)

        engine.generate(_ids(engine, rng, 8), params)  # warm-up
        first = ask(0)
        hits = [ask(1 + i) for i in range(shape.hits)]
        flood_tokens = shape.multiple * shape.ram_tokens
        num_flood = -(-flood_tokens // shape.flood_prompt_tokens)
        t0 = time.perf_counter()
        for _ in range(num_flood):
            engine.generate(_ids(engine, rng, shape.flood_prompt_tokens), params, owner="other")
        flood_s = time.perf_counter() - t0
        after = ask(1 + shape.hits)
        undisturbed = statistics.median(h.ttft_s for h in hits)
        reusable = (len(prefix) // config.block_size) * config.block_size
        return {
            "lease": lease,
            "prefix_tokens": len(prefix),
            "first_cached_tokens": first.cached_tokens,
            "undisturbed_ttft_s": undisturbed,
            "undisturbed_cached_tokens": min(h.cached_tokens for h in hits),
            "flood_requests": num_flood,
            "flood_tokens": num_flood * shape.flood_prompt_tokens,
            "flood_s": flood_s,
            "after_cached_tokens": after.cached_tokens,
            "after_prefix_reuse": min(after.cached_tokens, len(prefix)) / len(prefix),
            "after_reusable_reuse": min(after.cached_tokens, reusable) / max(1, reusable),
            "after_ttft_s": after.ttft_s,
            "ttft_ratio": after.ttft_s / undisturbed if undisturbed > 0 else None,
            "after_tier_hits": dict(after.tier_hits),
        }
    finally:
        engine.close()


def _generate(engine: Any, ids: list[int], params: Any, leases: list[LeaseRequest]) -> Any:
    result = None
    for event in engine.stream(ids, params, owner="agent", leases=leases):
        if event.finished:
            result = event.result
    assert result is not None
    return result


def run_flood(adapter: Any, size: str, config: CacheConfig, seed: int = 0) -> dict[str, Any]:
    """The flood with a lease, then without, on fresh engines; the result's "runs"."""
    shape = SHAPES[size]
    config = dataclasses.replace(
        config, ram_cache_bytes=shape.ram_tokens * adapter.kv_bytes_per_token
    )
    runs = []
    for lease in (True, False):
        run_config = dataclasses.replace(config, hash_seed=os.urandom(16))
        if config.ssd_cache_dir is not None:
            sub = "leased" if lease else "unleased"
            run_config.ssd_cache_dir = os.path.join(str(config.ssd_cache_dir), sub)
        runs.append(_run_once(adapter, shape, run_config, seed, lease))
    leased = runs[0]
    ratio = leased["ttft_ratio"]
    return {
        "workload": "flood",
        "size": size,
        "seed": seed,
        "ram_tokens": shape.ram_tokens,
        "multiple": shape.multiple,
        "block_size": config.block_size,
        "ssd": config.ssd_cache_dir is not None,
        "runs": runs,
        "meets_reuse_target": leased["after_reusable_reuse"] >= TARGET_REUSE,
        "meets_ttft_target": ratio is not None and ratio <= TARGET_TTFT_RATIO,
    }


def format_flood(result: dict[str, Any]) -> str:
    lines = [
        f"flood ({result['size']}): a {result['runs'][0]['prefix_tokens']}-token prefix, then "
        f"{result['runs'][0]['flood_tokens']} unrelated tokens ({result['multiple']}x a RAM "
        f"tier of {result['ram_tokens']} tokens; SSD {'on' if result['ssd'] else 'off'})"
    ]
    for run in result["runs"]:
        hits = ", ".join(f"{k} {v}" for k, v in sorted(run["after_tier_hits"].items())) or "-"
        ratio = "-" if run["ttft_ratio"] is None else f"{run['ttft_ratio']:.2f}x"
        lines.append(
            f"  {'leased  ' if run['lease'] else 'unleased'}: cached {run['after_cached_tokens']}"
            f"/{run['prefix_tokens']} of the prefix ({run['after_prefix_reuse']:.3f}; whole "
            f"blocks {run['after_reusable_reuse']:.3f}), TTFT "
            f"{run['after_ttft_s'] * 1e3:.1f} ms vs undisturbed hit "
            f"{run['undisturbed_ttft_s'] * 1e3:.1f} ms ({ratio}), tiers: {hits}"
        )
    lines.append(
        f"  targets (leased): reuse >= {TARGET_REUSE}: "
        f"{'met' if result['meets_reuse_target'] else 'NOT met'}; TTFT <= "
        f"{TARGET_TTFT_RATIO}x: {'met' if result['meets_ttft_target'] else 'NOT met'}"
    )
    return "\n".join(lines)
