"""`pagedkv bench`: run workloads cached and cold, compare with the ideal cache, report.

Order of the two passes: the cached pass runs first, because a conversation is
generated online (each turn carries the answer the model really gave) and the
cached pass fixes it. The cold pass then replays exactly the same prompt ids on
an engine with prefix caching off, with `max_tokens` set to what the cached
pass generated and `ignore_eos`, so both passes do the same decoding work; at
temperature 0 the outputs must match token for token, which the results count
(`outputs_identical`). Running cold first was rejected: the ideal needs the
generated ids of the pass it judges, so the cached pass would have to replay
the cold conversation and check that it reproduced the cold answers anyway.

Every workload gets a fresh temporary SSD directory and a fresh hash seed, so
neither an old `~/.cache/pagedkv/kv` nor a shared Redis can hand the run KV
that the ideal cache never saw; results are reproducible from the seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pagedkv.bench.concurrent import run_steps
from pagedkv.bench.html_report import write_html
from pagedkv.bench.ideal import IdealCache
from pagedkv.bench.render import Renderer
from pagedkv.bench.report import RequestRecord, format_table, summarize, write_json, write_plot
from pagedkv.bench.workloads import DEFAULT_WORKLOADS, Message, Workload, build_workload
from pagedkv.config import CacheConfig, default_ssd_cache_dir

WARMUP_TEXT = "Warm-up request: say hello."


def bench_size(args: argparse.Namespace) -> str:
    """`args.size` ("tiny", "quick", "full") when a caller sets it, else --quick."""
    return str(getattr(args, "size", None) or ("quick" if args.quick else "full"))


def main(args: argparse.Namespace) -> int:
    if getattr(args, "no_prefix_cache", False):
        print(
            "pagedkv bench measures prefix caching: drop --no-prefix-cache (the cold pass "
            "already runs with the cache off)",
            file=sys.stderr,
        )
        return 2
    names = list(args.workload or DEFAULT_WORKLOADS)
    size = bench_size(args)
    if args.url and "agent-reasoning" in names:
        print(
            "the agent-reasoning workload serves the model under a chat template of its "
            "own, which a remote server does not use: run it without --url",
            file=sys.stderr,
        )
        return 2
    flood, vision = "flood" in names, "vision" in names
    names = [n for n in names if n not in ("flood", "vision")]
    if flood:
        code = _flood(args, size)
        if code or not (names or vision):
            return code
    if vision:
        code = _vision(args, size)
        if code or not names:
            return code
    if args.url:
        from pagedkv.bench.remote import run_remote

        results = run_remote(args, names, size)
    else:
        results = run_local(args, names, size)
    if not results:
        print("no workload ran", file=sys.stderr)
        return 1
    print(format_table(results))
    for r in results:
        for note in r.get("notes", []):
            print(f"note ({r['workload']}): {note}")
    if args.out:
        out = Path(args.out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        write_json(results, out / "results.json")
        write_plot(results, out / "results.png")
        write_html(results, out / "report.html")
        print(f"wrote {out / 'results.json'}, {out / 'results.png'} and {out / 'report.html'}")
    return 0


def _flood(args: argparse.Namespace, size: str) -> int:
    """The flood workload (`bench/flood.py`), local only: it leases through the engine."""
    if args.url:
        print("--workload flood runs a local engine: leave out --url", file=sys.stderr)
        return 2
    from pagedkv.bench.flood import format_flood, run_flood
    from pagedkv.flags import cache_config_from_args

    adapter = _load_on_a_passing_thread(args)
    base = cache_config_from_args(args)
    adapter.set_kv_dtype(base.kv_dtype)
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-flood-") as tmp:
        ssd = Path(tmp) if base.ssd_cache_dir is not None else None
        result = run_flood(adapter, size, dataclasses.replace(base, ssd_cache_dir=ssd), args.seed)
    print(format_flood(result))
    if args.out:
        out = Path(args.out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        (out / "flood.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out / 'flood.json'}")
    return 0


def _vision(args: argparse.Namespace, size: str) -> int:
    """The vision workload (`bench/vision.py`), local only: images go to the engine."""
    if args.url:
        print("--workload vision runs a local engine: leave out --url", file=sys.stderr)
        return 2
    from pagedkv.bench.vision import (
        NotAVisionModelError,
        check_takes_images,
        format_vision,
        run_vision,
    )
    from pagedkv.flags import cache_config_from_args, scheduler_config_from_args

    adapter = _load_on_a_passing_thread(args)
    try:
        check_takes_images(adapter, args.model)
    except NotAVisionModelError as exc:
        print(exc, file=sys.stderr)
        return 2
    base = cache_config_from_args(args)
    adapter.set_kv_dtype(base.kv_dtype)
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-vision-") as tmp:
        config = dataclasses.replace(
            base,
            hash_seed=os.urandom(16),
            ssd_cache_dir=Path(tmp) if base.ssd_cache_dir is not None else None,
        )
        result = run_vision(adapter, size, config, args.seed, scheduler_config_from_args(args))
    print(format_table([result]))
    print(format_vision(result))
    if args.out:
        out = Path(args.out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        write_json([result], out / "vision.json")
        print(f"wrote {out / 'vision.json'}")
    return 0


def run_local(args: argparse.Namespace, names: Sequence[str], size: str) -> list[dict[str, Any]]:
    from pagedkv.flags import cache_config_from_args, scheduler_config_from_args

    adapter = _load_on_a_passing_thread(args)
    base = cache_config_from_args(args)
    adapter.set_kv_dtype(base.kv_dtype)  # so kv_bytes_per_token below sizes the RAM tier
    parent: Path | None = None
    if base.ssd_cache_dir is not None and Path(base.ssd_cache_dir) != default_ssd_cache_dir():
        parent = Path(base.ssd_cache_dir)  # an explicit disk: the fresh directory goes there
        parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-", dir=parent) as tmp:
        for name in names:
            workload = build_workload(name, size, args.seed)
            config = dataclasses.replace(
                base,
                hash_seed=os.urandom(16),
                ssd_cache_dir=Path(tmp) / name if base.ssd_cache_dir is not None else None,
            )
            if base.ram_cache_bytes is None and workload.ram_cache_tokens:
                config.ram_cache_bytes = workload.ram_cache_tokens * adapter.kv_bytes_per_token
            results.append(
                run_workload(
                    adapter,
                    workload,
                    config,
                    concurrency=getattr(args, "concurrency", 1),
                    scheduling=scheduler_config_from_args(args),
                )
            )
    return results


def _load_on_a_passing_thread(args: argparse.Namespace) -> Any:
    """Load the model on a thread that then ends, taking its OpenMP team with it:
    the engines' workers stay the only threads that compute, as under `pagedkv
    serve` (docs/architecture.md, "One thread computes")."""
    from pagedkv.model import load_model

    with ThreadPoolExecutor(1, thread_name_prefix="pagedkv-load") as pool:  # joined on exit
        return pool.submit(load_model, args.model, device=args.device, dtype=args.dtype).result()


def run_workload(
    adapter: Any,
    workload: Workload,
    config: CacheConfig,
    concurrency: int = 1,
    scheduling: Any = None,
) -> dict[str, Any]:
    """The cached pass (online conversation), then the cold replay of its measured prompts,
    each with `concurrency` users at once, under the workload's chat template if it has one."""
    own_template = adapter.tokenizer.chat_template
    if workload.chat_template is not None:  # put back in the `finally` below
        adapter.tokenizer.chat_template = workload.chat_template
    try:
        return _run_workload(adapter, workload, config, concurrency, scheduling)
    finally:
        adapter.tokenizer.chat_template = own_template


def _run_workload(
    adapter: Any,
    workload: Workload,
    config: CacheConfig,
    concurrency: int,
    scheduling: Any,
) -> dict[str, Any]:
    from pagedkv.engine import Engine, SamplingParams
    from pagedkv.engine.reasoning import next_turn_ids

    render = Renderer(adapter.apply_chat_template, adapter.encode)
    follows = _next_roles(workload)
    next_forms: dict[int, list[int]] = {}
    stores: dict[str, int] = {}  # what store_next_turn did, by outcome
    measured = workload.measured_steps
    ideal = IdealCache()
    lock = threading.Lock()
    histories: dict[int, list[Message]] = {}
    done: dict[int, tuple[RequestRecord, list[int], list[int]]] = {}
    notes: list[str] = []
    if workload.restart_at is not None and config.ssd_cache_dir is None:
        notes.append("no SSD tier (--no-ssd-cache): the restarted engine starts empty")
    bar = tqdm(
        total=len(workload.steps) + len(measured),
        desc=workload.name,
        unit="req",
        file=sys.stderr,
        dynamic_ncols=True,
    )

    submitted: list[tuple[int, list[int]]] = []  # (step, prompt) in submission order
    misses: dict[str, int] = {}  # why each request's first recomputed token missed

    def cached_step(i: int) -> None:
        step = workload.steps[i]
        history = histories.setdefault(step.session, [])
        history.extend(step.messages)
        prompt = render(history)
        params = SamplingParams(max_tokens=step.max_tokens, temperature=0.0)
        with lock:
            submitted.append((i, prompt))
            miss = engine.explain(prompt).miss
            reason = "hit" if miss is None else miss.reason
            misses[reason] = misses.get(reason, 0) + 1
            stream = engine.stream(prompt, params)
        r = None
        for event in stream:
            if event.finished:
                r = event.result
        assert r is not None
        history.append({"role": "assistant", "content": r.text})
        if workload.ideal_next_form:
            next_forms[i] = next_turn_ids(adapter.apply_chat_template, history, follows[i])
        # Reasoning-aware storing (`--reasoning-cache`): None when the policy is off.
        stored = engine.store_next_turn(history, prompt + list(r.token_ids), follow=follows[i])
        outcome = "off" if stored is None else "queued" if stored.submitted else "not needed"
        with lock:
            stores[outcome] = stores.get(outcome, 0) + 1
        record = RequestRecord(
            step=i,
            session=step.session,
            turn=step.turn,
            prompt_tokens=r.prompt_tokens,
            cached_tokens=r.cached_tokens,
            ideal_tokens=None,
            generated_tokens=len(r.token_ids),
            ttft_cached_s=r.ttft_s,
            total_cached_s=r.total_s,
            tier_hits=dict(r.tier_hits),
        )
        done[i] = (record, prompt, list(r.token_ids))
        bar.update()

    t_start = time.perf_counter()
    engine = Engine(adapter, config, scheduling=scheduling)
    try:
        _warm_up(engine, ideal)
        indices = list(range(len(workload.steps)))
        if workload.restart_at is not None:
            run_steps(workload.steps, indices[: workload.restart_at], concurrency, cached_step)
            engine.close()
            if config.ssd_cache_dir is not None:
                _drop_page_cache(Path(config.ssd_cache_dir))
            engine = Engine(adapter, config, scheduling=scheduling)
            _warm_up(engine, ideal)
        t0 = time.perf_counter()
        run_steps(workload.steps, list(measured), concurrency, cached_step)
        cached_wall = time.perf_counter() - t0
        stats = engine.cache_stats()
        reasoning_policy = engine.reasoning.describe()
    finally:
        engine.close()
    # The ideal reuses whatever any earlier-submitted request computed, as if each had
    # finished before the next one started: with several users at once the engine
    # cannot reuse what is still being computed, and that shows as reuse below it.
    for i, prompt in submitted:
        reusable = ideal.observe(prompt, done[i][2])
        if i in next_forms:  # the turn as the next request sends it (a template re-render)
            ideal.remember(next_forms[i], [])
        if i in measured:
            done[i][0].ideal_tokens = reusable
    records = [done[i][0] for i in measured]
    prompts = [done[i][1] for i in measured]
    outputs = [done[i][2] for i in measured]

    cold = Engine(
        adapter,
        dataclasses.replace(
            config, enable_prefix_caching=False, ssd_cache_dir=None, redis_url=None
        ),
        scheduling=scheduling,
    )

    def cold_step(i: int) -> None:
        k = i - measured.start
        rec, prompt, want = records[k], prompts[k], outputs[k]
        r = cold.generate(
            prompt,
            SamplingParams(max_tokens=rec.generated_tokens, temperature=0.0, ignore_eos=True),
        )
        rec.ttft_cold_s, rec.total_cold_s = r.ttft_s, r.total_s
        rec.cold_cached_tokens = r.cached_tokens
        rec.same_output = list(r.token_ids) == want
        bar.update()

    try:
        _warm_up(cold, None)
        t0 = time.perf_counter()
        run_steps(workload.steps, list(measured), concurrency, cold_step)
        cold_wall = time.perf_counter() - t0
    finally:
        cold.close()
        bar.close()
    if render.kind != "chat template":
        notes.append(f"prompts rendered as a {render.kind}")
    if concurrency > 1:
        notes.append(
            f"{concurrency} users at once: the ideal counts every earlier-submitted "
            "request as finished; reuse below it includes what concurrency made impossible"
        )
    return summarize(
        workload=workload.name,
        model=adapter.name,
        mode="local",
        records=records,
        cached_wall_s=cached_wall,
        cold_wall_s=cold_wall,
        wall_s=time.perf_counter() - t_start,
        extra={
            "size": workload.size,
            "seed": workload.seed,
            "description": workload.description,
            "concurrency": concurrency,
            "block_size": config.block_size,
            "kv_dtype": config.kv_dtype,
            "kv_bytes_per_token": (
                stats.cache.bytes_per_token if stats.cache else adapter.kv_bytes_per_token
            ),
            "ram_cache_bytes": config.ram_cache_bytes,
            "tiers": ["ram"]
            + (["ssd"] if config.ssd_cache_dir else [])
            + (["redis"] if config.redis_url else []),
            "cold_pass": "same prompt ids, prefix caching off, max_tokens = cached pass's "
            "output length, ignore_eos, same concurrency",
            "ideal_method": "exact: prompt ids + generated ids of the cached pass"
            + (", and each turn in the next request's form" if workload.ideal_next_form else ""),
            "reasoning_cache": reasoning_policy,
            "next_turn_stores": stores,
            "prompt_format": render.kind,
            "miss_reasons": misses,
            "cache_stats": dataclasses.asdict(stats),
            "notes": notes,
        },
    )


def _next_roles(workload: Workload) -> dict[int, str]:
    """Per step, the role of the first message its session sends next ("user" after
    the session's last step): what a server learns from parsing the reply's tool call."""
    out: dict[int, str] = {}
    last: dict[int, int] = {}
    for i, step in enumerate(workload.steps):
        if step.session in last:
            out[last[step.session]] = step.messages[0]["role"]
        last[step.session] = i
    for i in last.values():
        out[i] = "user"
    return out


def _warm_up(engine: Any, ideal: IdealCache | None) -> None:
    """One short request so that the first measured one pays no one-off setup. Its
    tokens enter the ideal cache too: the engine may reuse them (a BOS, say)."""
    from pagedkv.engine import SamplingParams

    prompt = engine.tokenize(WARMUP_TEXT)
    r = engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    if ideal is not None:
        ideal.remember(prompt, r.token_ids)


def _drop_page_cache(directory: Path) -> None:
    """Make the restarted engine read the SSD tier from disk, not the page cache."""
    if not hasattr(os, "posix_fadvise"):
        return
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
