"""One decode step of 8 rows, in-process: the base model, LoRA rows grouped per adapter
(what pagedkv does, `model/lora_layers.py`), and stacked masked products (the
alternative it rejected: every adapter's A in one product, each row masked to its
own adapter's columns, then the stacked B).

    .venv/bin/python benchmarks/bench_lora_products.py [--repeats 8] [--rank 16]

Rows: base, a1, a2, a3, a4, base, a1, a2 (4 adapters of rank `--rank` on q, k, v
and o, as `bench_lora.py` writes them), each at 64 tokens of context; the three
ways alternate step by step on the worker thread. Prints each way's median and
best step time and the base step's median over each way's (the tokens/s ratio).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_lora import write_adapter

from pagedkv import CacheConfig, Engine
from pagedkv.model.batch import SeqChunk
from pagedkv.model.lora_layers import LoraLayers


def stacked_hook(layers: LoraLayers, path: str, cache: dict) -> Any:
    """The rejected way: two products per layer whatever the number of adapters."""

    def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        groups = layers._groups
        if not groups:
            return None
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        key = (path, tuple(id(g.lora) for g in groups))
        if key not in cache:
            a = torch.cat([g.lora.modules[path][0] for g in groups]).float()
            b = torch.cat([g.lora.modules[path][1] * g.lora.scale for g in groups], 1).float()
            cache[key] = (a, b)
        a, b = cache[key]
        mask = torch.zeros(x.shape[0], a.shape[0])
        col = 0
        for g in groups:
            mask[g.rows, col : col + g.lora.rank] = 1
            col += g.lora.rank
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, a) * mask, b)
        output.view(-1, output.shape[-1]).add_(delta)
        return output

    return hook


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    config = CacheConfig(enable_prefix_caching=False)
    with (
        Engine.from_pretrained(args.model, config=config) as engine,
        tempfile.TemporaryDirectory(prefix="bench-lora-products-") as tmp,
    ):
        names = ["a1", "a2", "a3", "a4"]
        for i, name in enumerate(names):
            engine.load_adapter(name, write_adapter(engine, Path(tmp) / name, args.rank, i))
        held = {n: engine.adapters.acquire(n) for n in names}
        mixed = [None, held["a1"], held["a2"], held["a3"], held["a4"], None]
        mixed += [held["a1"], held["a2"]]
        times: dict[str, list[float]] = {"base": [], "grouped": [], "stacked": []}

        def work() -> None:
            model = engine.adapter
            layers = model.lora_layers
            modules = dict(model.model.named_modules())
            grouped = {p: modules[p]._forward_hooks.copy() for p in layers._hooked}
            cache: dict = {}
            stacked = {p: stacked_hook(layers, p, cache) for p in layers._hooked}
            kvs = [model.new_kv_buffer(64 + 3 * args.repeats + 8) for _ in mixed]
            prompt = list(range(3, 67))
            model.forward_batch([SeqChunk(kv, 0, prompt, True, True) for kv in kvs])
            pos = len(prompt)
            for _ in range(args.repeats + 1):  # the first round warms every shape
                for way in times:
                    for p in layers._hooked:
                        hooks = modules[p]._forward_hooks
                        hooks.clear()
                        if way == "stacked":
                            modules[p].register_forward_hook(stacked[p])
                        else:
                            hooks.update(grouped[p])
                    which = [None] * len(mixed) if way == "base" else mixed
                    chunks = [
                        SeqChunk(kv, pos, [5], True, False, w)
                        for kv, w in zip(kvs, which, strict=True)
                    ]
                    start = time.perf_counter()
                    model.forward_batch(chunks)
                    times[way].append(time.perf_counter() - start)
                    pos += 1
            for p in layers._hooked:  # the engine's own hooks back
                modules[p]._forward_hooks.clear()
                modules[p]._forward_hooks.update(grouped[p])

        engine._call(work)
    base = statistics.median(times["base"][1:])
    for way, values in times.items():
        median, best = statistics.median(values[1:]), min(values[1:])
        print(
            f"{way:8s} median {median * 1000:8.1f} ms  best {best * 1000:8.1f} ms  "
            f"base/this {base / median:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
