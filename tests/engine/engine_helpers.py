"""What the engine tests across tiers share: prompts, the cache-off reference, a worker."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from pagedkv import CacheConfig, Engine, SamplingParams

BS = 8  # small blocks so that tiny prompts span many of them
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
WORKER = Path(__file__).with_name("engine_worker.py")


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def reference_outputs(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy token ids with prefix caching off: what every cached run must equal."""
    with Engine.from_pretrained(str(model), config=CacheConfig(enable_prefix_caching=False)) as off:
        return [off.generate(p, GREEDY).token_ids for p in prompts]


def run_worker(model: Path, cache: dict[str, Any], prompts: list[list[int]]) -> list[dict]:
    """Run `engine_worker.py` in a new process; its JSON lines."""
    spec = {"model": str(model), "cache": cache, "prompts": prompts, "max_tokens": 8}
    out = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
