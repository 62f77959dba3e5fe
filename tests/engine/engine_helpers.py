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


# A request's greedy tokens and their log-probs.
Answer = tuple[list[int], list[float]]


def answers(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Answer]:
    """Each prompt's answer, one request at a time (`params` must ask for logprobs)."""
    out = []
    for p in prompts:
        r = eng.generate(p, params)
        assert r.logprobs is not None
        out.append((r.token_ids, r.logprobs))
    return out


def same_answers(got: list[Answer], want: list[Answer], tol: float) -> None:
    """Identical tokens, log-probs within `tol`."""
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol


def random_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def two_prompts() -> list[list[int]]:
    """Two prompts sharing a 29-token prefix (several blocks), the first 37 tokens long
    before its own suffix."""
    shared = random_prompt(5, 37)
    return [shared + random_prompt(6, 5), shared[:29] + random_prompt(7, 9)]


def reference_outputs(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy token ids with prefix caching off: what every cached run must equal."""
    with Engine.from_pretrained(str(model), config=CacheConfig(enable_prefix_caching=False)) as off:
        return [off.generate(p, GREEDY).token_ids for p in prompts]


def run_worker(
    model: Path,
    cache: dict[str, Any],
    prompts: list[list[int]],
    loras: dict[str, str] | None = None,
    adapters: list[str | None] | None = None,
    image_chats: list[dict[str, Any]] | None = None,
) -> list[dict]:
    """Run `engine_worker.py` in a new process; its JSON lines. `loras`: adapters it
    loads (name: directory); `adapters`: the one each prompt runs with; `image_chats`:
    chats about tiny images it renders and runs after the prompts."""
    spec = {"model": str(model), "cache": cache, "prompts": prompts, "max_tokens": 8}
    if loras:
        spec.update(loras=loras, adapters=adapters or [None] * len(prompts))
    if image_chats:
        spec.update(image_chats=image_chats)
    out = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def mlx_engine(model: Path, scheduling: Any = None, **cache: Any) -> Engine:
    """An engine on the MLX backend (`scheduling`: an `engine.SchedulerConfig`)."""
    config = CacheConfig(block_size=BS, ram_cache_bytes=64 * 2**20, backend="mlx", **cache)
    return Engine.from_pretrained(str(model), config=config, scheduling=scheduling)


def mlx_fresh(model: Path, prompts: list[list[int]], **cache: Any) -> list[list[int]]:
    """Greedy tokens on MLX with prefix caching off: what every cached run must equal
    (the promise is within one backend)."""
    with mlx_engine(model, enable_prefix_caching=False, **cache) as off:
        assert off.adapter.backend_name == "mlx"
        return [off.generate(p, GREEDY).token_ids for p in prompts]
