"""LoRA adapters in one batch: 8 streams over 4 adapters and the base against 8 base
streams, in the same run; and how long loading an adapter pauses running streams.

    .venv/bin/python benchmarks/bench_lora.py [--model smollm2-135m] [--rank 16]
        [--streams 8] [--prompt-tokens 64] [--max-tokens 64] [--repeats 2]

Adapters are random PEFT LoRA directories written here (safetensors + config, rank
`--rank` on q, k, v and o of every layer: the common choice), so nothing is
downloaded. Each pass submits `--streams` requests at once (distinct prompts,
caching off, greedy, `--max-tokens` each) and counts generated tokens over the
pass's wall time; the base and mixed passes alternate, `--repeats` of each, and the
best of each is compared (the ratio is mixed over base; target >= 0.7).
The load check runs `--streams` base streams, loads a fifth adapter half-way and
reports the largest gap between two tokens of any stream while it loaded, next
to the median gap (one step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedkv import CacheConfig, Engine, SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_adapter(engine: Engine, directory: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter for the engine's model (non-zero B)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, module in engine.adapter.model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] in TARGETS:
            key = f"base_model.model.{path}"
            a = torch.randn(rank, module.in_features, generator=gen) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, generator=gen) * 0.02
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = b
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    config["target_modules"] = list(TARGETS)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def run_pass(engine: Engine, prompts: list[list[int]], loras: list[str | None], n: int) -> float:
    """Tokens per second of all streams at once."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    streams = [engine.stream(p, params, lora=w) for p, w in zip(prompts, loras, strict=True)]
    tokens = 0
    for stream in streams:
        for event in stream:
            if event.finished and event.result is not None:
                tokens += len(event.result.token_ids)
    return tokens / (time.perf_counter() - start)


def load_pause(engine: Engine, prompts: list[list[int]], directory: Path, n: int) -> dict:
    """Largest gap between two tokens of any stream while an adapter loaded, and the
    median gap."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    stamps: list[list[float]] = [[] for _ in prompts]
    streams = [engine.stream(p, params) for p in prompts]

    def read(i: int) -> None:
        for _ in streams[i]:
            stamps[i].append(time.perf_counter())

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for t in readers:
        t.start()
    while min(len(s) for s in stamps) < n // 3:
        time.sleep(0.002)
    began = time.perf_counter()
    info = engine.load_adapter("late", directory)
    ended = time.perf_counter()
    for t in readers:
        t.join()
    gaps = sorted(b - a for s in stamps for a, b in itertools.pairwise(s))
    during = [b - a for s in stamps for a, b in itertools.pairwise(s) if b >= began and a <= ended]
    return {
        "load_s": ended - began,
        "install_s": info["install_s"],
        "median_gap_ms": 1000 * gaps[len(gaps) // 2],
        "max_gap_during_load_ms": 1000 * max(during, default=0.0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    config = CacheConfig(enable_prefix_caching=False)
    with (
        Engine.from_pretrained(args.model, config=config) as engine,
        tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp,
    ):
        root = Path(tmp)
        names = [f"a{i}" for i in range(1, 5)]
        for i, name in enumerate(names):
            engine.load_adapter(name, write_adapter(engine, root / name, args.rank, i))
        vocab = engine.vocab_size
        prompts = [
            [(97 * s + 13 * t + 5) % vocab for t in range(args.prompt_tokens)]
            for s in range(args.streams)
        ]
        mixed = [([None, *names] * args.streams)[i] for i in range(args.streams)]
        base_runs, mixed_runs = [], []
        run_pass(engine, prompts, mixed, 4)  # warm the kernels of every shape
        for _ in range(args.repeats):
            base_runs.append(run_pass(engine, prompts, [None] * args.streams, args.max_tokens))
            mixed_runs.append(run_pass(engine, prompts, mixed, args.max_tokens))
        pause = load_pause(
            engine, prompts, write_adapter(engine, root / "late", args.rank, 99), args.max_tokens
        )
    base, mix = max(base_runs), max(mixed_runs)
    print(f"model {args.model}, rank {args.rank}, {args.streams} streams, mixed: {mixed}")
    print(f"base streams:  {base:7.1f} tokens/s  (runs {', '.join(f'{r:.1f}' for r in base_runs)})")
    print(f"mixed streams: {mix:7.1f} tokens/s  (runs {', '.join(f'{r:.1f}' for r in mixed_runs)})")
    print(f"ratio mixed/base: {mix / base:.2f}  (target >= 0.7)")
    print(
        f"load while {args.streams} streams decode: {pause['load_s'] * 1000:.0f} ms in all, "
        f"{pause['install_s'] * 1000:.3f} ms on the worker; largest gap between tokens during "
        f"the load {pause['max_gap_during_load_ms']:.1f} ms, median gap "
        f"{pause['median_gap_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
