"""TTFT of a 4K-token cached prefix + 64 new tokens, against cold and against the limit.

    .venv/bin/python benchmarks/bench_ttft.py [--model smollm2-135m] [--prefix 4096]
        [--tiers ram,ssd,redis] [--redis-url URL] [--kv-dtypes auto,bfloat16,int8]

For each tier the cached prefix is restored from, the warm TTFT is compared with
- the cold TTFT (the same prompt with prefix caching off), and
- the limit: prefilling only the 64 new tokens on a ready-made transformers
  cache, plus the prefix's KV bytes divided by the bandwidth of the medium the
  tier restores from (memory copy for RAM; for SSD the faster of a buffered and
  an O_DIRECT sequential read of a cold 512 MiB file (`disk_reads.py`), each
  measured before every run and taken by its median, since this virtual disk's
  speed moves between runs; for Redis, a second engine with empty RAM and no
  SSD, the target is only the ratio to cold), all measured in this run.

With several `--kv-dtypes`, each tier runs every dtype in turn for each run, and
reports the restore part of the TTFT (warm TTFT minus the float32 suffix-only
prefill: reading the KV, plus attention's upcast of the compact prefix) against
the first dtype's.

SSD and Redis runs each start a fresh process, as a restarted or second server
would be; the SSD block files' pages are dropped from the page cache first
(and checked gone). `--learn` untimed SSD restarts come first, in which the
store measures its read paths and keeps the faster (`storage/ssd/reader.py`),
as a directory that has served a while has; the path chosen is printed.

The last lines, `SUMMARY ...`, hold each row's figures as `key=value` pairs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from pagedkv import CacheConfig, Engine, GenerationResult, SamplingParams
from pagedkv.model import load_model
from pagedkv.storage.ssd.reader import CHOICE_NAME

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_reads import drop_cache, sequential_reads, write_probe

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompt_ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n,), generator=g).tolist()


def memory_bandwidth(num_bytes: int = 512 * 2**20) -> float:
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return num_bytes / best


def drop_page_cache(directory: Path) -> None:
    drop_cache([Path(root, name) for root, _, files in os.walk(directory) for name in files])


def start_redis(directory: Path) -> str:
    """A private redis-server for this run (stopped when the benchmark exits)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            "2gb",
            "--maxmemory-policy",
            "allkeys-lru",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
    )
    atexit.register(proc.terminate)
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def suffix_only_prefill(model: str, prefix: list[int], suffix: list[int], runs: int) -> float:
    """Median time to prefill `suffix` on a ready-made cache already holding `prefix`:
    the faster of transformers' own DynamicCache and pagedkv's presized GrowableLayer
    cache, so the limit is never inflated by a cache layout."""
    adapter = load_model(model)
    _, cache = adapter.forward(prefix, adapter.new_cache())
    layers = [(k.clone(), v.clone()) for k, v in adapter.cache_layers(cache)]
    need = len(prefix) + len(suffix)
    makers = {
        "DynamicCache": lambda: DynamicCache(
            [(k.clone(), v.clone()) for k, v in layers], config=adapter.config
        ),
        "GrowableLayer": lambda: adapter.build_cache(layers, capacity=need),
    }
    best = float("inf")
    for make in makers.values():
        times = []
        for _ in range(runs):
            ready = make()
            t = time.perf_counter()
            adapter.forward(suffix, ready)
            times.append(time.perf_counter() - t)
        best = min(best, statistics.median(times))
    return best


def _timing(result: GenerationResult) -> tuple[float, int]:
    return result.ttft_s, result.cached_tokens


def restarted(model: str, cache: dict[str, object], prompt: list[int]) -> tuple[float, int]:
    """(TTFT, cached tokens) of `prompt` in a freshly started process, as after a
    restart of the server: nothing in RAM, no warm allocator or threads."""
    spec = json.dumps({"model": model, "cache": cache, "prompt": prompt})
    out = subprocess.run(
        [sys.executable, __file__, "--child", spec],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    ttft, cached = json.loads(out.stdout.strip().splitlines()[-1])
    return float(ttft), int(cached)


def child(spec_json: str) -> int:
    spec = json.loads(spec_json)
    with Engine.from_pretrained(spec["model"], config=CacheConfig(**spec["cache"])) as eng:
        print(json.dumps(_timing(eng.generate(spec["prompt"], ONE))))
    return 0


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child(sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tiers", default="ram,ssd")
    ap.add_argument(
        "--learn", type=int, default=6,
        help="unmeasured SSD restarts first, in which the store picks its read path",
    )  # fmt: skip
    ap.add_argument(
        "--cold-runs", type=int, default=None,
        help="prompts timed with caching off (default: max(2, runs - 1)); only the "
        "cold/warm column uses them",
    )  # fmt: skip
    ap.add_argument("--redis-url", default=None, help="default: start a private redis-server")
    ap.add_argument(
        "--kv-dtypes",
        default="auto",
        help="comma-separated kv_dtype values, run interleaved; the first is the baseline "
        "of the 'restore x' column (restore = warm TTFT - suffix-only prefill)",
    )
    args = ap.parse_args()
    tiers = args.tiers.split(",")
    kv_dtypes = args.kv_dtypes.split(",")

    off = Engine.from_pretrained(args.model, config=CacheConfig(enable_prefix_caching=False))
    vocab = off.adapter.model.config.vocab_size
    prefix = prompt_ids(args.prefix, 0, vocab)
    suffixes = [prompt_ids(args.suffix, 1 + i, vocab) for i in range(args.runs + 1)]
    kv_bytes = {}
    for kd in kv_dtypes:
        off.adapter.set_kv_dtype(kd)
        kv_bytes[kd] = args.prefix * off.adapter.kv_bytes_per_token
    off.adapter.set_kv_dtype("auto")
    cold = statistics.median(
        off.generate(prefix + s, ONE).ttft_s
        for s in suffixes[: args.cold_runs or max(2, args.runs - 1)]
    )
    off.close()
    # In a thread of its own, as the engine runs its forwards: a forward on the main
    # thread would leave an OpenMP team behind that slows every later engine's worker.
    measured: list[float] = []
    thread = threading.Thread(
        target=lambda: measured.append(
            suffix_only_prefill(args.model, prefix, suffixes[0], args.runs)
        )
    )
    thread.start()
    thread.join()
    prefill = measured[0]
    rows = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("PAGEDKV_BENCH_DIR")) as tmp:
        if "ram" in tiers:
            bw = memory_bandwidth()
            for kd in kv_dtypes:
                eng = Engine.from_pretrained(
                    args.model, config=CacheConfig(ram_cache_bytes=2 * 2**30, kv_dtype=kd)
                )
                eng.generate(prefix + suffixes[0], ONE)
                warm = [_timing(eng.generate(prefix + s, ONE)) for s in suffixes[1:]]
                eng.close()
                rows.append(("ram", kd, warm, bw, "memory copy"))
        if "ssd" in tiers:
            cfgs = {
                kd: {
                    "ram_cache_bytes": 2 * 2**30,
                    "ssd_cache_dir": str(Path(tmp) / f"kv-{kd}"),
                    "ssd_cache_bytes": 8 * 2**30,
                    "hash_seed": "bench",
                    "kv_dtype": kd,
                }
                for kd in kv_dtypes
            }
            for cfg in cfgs.values():
                restarted(args.model, cfg, prefix + suffixes[0])
            for _ in range(args.learn):  # the store measures its read paths (ssd/reader.py)
                for cfg in cfgs.values():
                    drop_page_cache(Path(str(cfg["ssd_cache_dir"])))
                    restarted(args.model, cfg, prefix + suffixes[0])
            probe = write_probe(Path(tmp) / "bandwidth.probe", 512 * 2**20)
            disk: dict[str, list[float]] = {"buffered": [], "O_DIRECT": []}
            warm_ssd: dict[str, list[tuple[float, int]]] = {kd: [] for kd in kv_dtypes}
            for s in suffixes[1:]:  # a restart for each run: empty RAM, cold page cache
                for how, rate in sequential_reads(probe).items():  # the disk of this run
                    disk[how].append(rate)
                for kd, cfg in cfgs.items():  # interleaved, so load changes hit all alike
                    drop_page_cache(Path(str(cfg["ssd_cache_dir"])))
                    warm_ssd[kd].append(restarted(args.model, cfg, prefix + s))
            probe.unlink()
            for kd, cfg in cfgs.items():
                choice = Path(str(cfg["ssd_cache_dir"])) / CHOICE_NAME
                state = json.loads(choice.read_text()) if choice.exists() else {}
                learned = "; ".join(
                    f"{p} " + " ".join(f"{x:.0f}" for x in v)
                    for p, v in state.get("mib_s", {}).items()
                )
                notes.append(
                    f"ssd {kd}: read path {state.get('path', 'direct (no figures kept)')} "
                    f"(its restores' MiB/s: {learned or '-'})"
                )
            medians = {how: statistics.median(v) for how, v in disk.items()}
            bw = max(medians.values())
            notes.append(
                "disk sequential read, median of the runs: "
                + ", ".join(f"{how} {r / 1e9:.2f} GB/s" for how, r in medians.items())
            )
            for kd in kv_dtypes:
                rows.append(("ssd", kd, warm_ssd[kd], bw, "disk sequential read"))
        if "redis" in tiers:
            url = args.redis_url or start_redis(Path(tmp))
            rcfgs = {
                kd: {"ram_cache_bytes": 2 * 2**30, "redis_url": url, "kv_dtype": kd}
                for kd in kv_dtypes
            }
            for cfg in rcfgs.values():
                restarted(args.model, cfg, prefix + suffixes[0])
            warm_redis: dict[str, list[tuple[float, int]]] = {kd: [] for kd in kv_dtypes}
            for s in suffixes[1:]:
                for kd, cfg in rcfgs.items():
                    warm_redis[kd].append(restarted(args.model, cfg, prefix + s))
            for kd in kv_dtypes:
                rows.append(("redis", kd, warm_redis[kd], float("nan"), "n/a"))

    print(
        f"model {args.model}, prefix {args.prefix} tokens cached + {args.suffix} new, "
        f"median of {args.runs}; KV "
        + ", ".join(f"{kd} {b / 2**20:.1f} MiB" for kd, b in kv_bytes.items())
    )
    print(f"cold TTFT {cold * 1000:.0f} ms; suffix-only prefill {prefill * 1000:.1f} ms")
    for note in notes:
        print(note)
    print(
        f"{'tier':6} {'kv':9} {'cached':>7} {'warm ms':>8} {'cold/warm':>9} {'limit ms':>9} "
        f"{'warm/limit':>10} {'restore ms':>10} {'restore x':>9}  bandwidth"
    )
    base: dict[str, float] = {}
    summary = []
    for name, kd, warm, bw, what in rows:
        t = statistics.median(ttft for ttft, _ in warm)
        cached = min(n for _, n in warm)
        limit = prefill + kv_bytes[kd] / bw if bw == bw else float("nan")
        restore = t - prefill
        base.setdefault(name, restore)
        print(
            f"{name:6} {kd:9} {cached:>7} {t * 1000:>8.1f} {cold / t:>9.1f} {limit * 1000:>9.1f} "
            f"{t / limit:>10.2f} {restore * 1000:>10.1f} {restore / base[name]:>9.2f}  "
            f"{bw / 1e9:.1f} GB/s ({what})"
        )
        summary.append(
            f"SUMMARY tier={name} kv={kd} cached={cached} warm_ms={t * 1000:.1f} "
            f"limit_ms={limit * 1000:.1f} warm_over_limit={t / limit:.3f} "
            f"cold_over_warm={cold / t:.1f} bandwidth_gb_s={bw / 1e9:.2f} "
            f"runs_ms={','.join(f'{ttft * 1000:.0f}' for ttft, _ in warm)}"
        )
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
