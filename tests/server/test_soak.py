"""A soak through a real HTTP server: hundreds of requests, random cancellations and
client disconnects, faults injected in a tier and in the cache path. Afterwards no
block is held, the pool checks, the worker lives and the threads are back."""

from __future__ import annotations

import collections
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn

from pagedkv import CacheConfig, Engine
from pagedkv.engine import SchedulerConfig
from pagedkv.server.app import create_app
from pagedkv.server.render_pool import DEFAULT_RENDER_THREADS

pytestmark = pytest.mark.slow

REQUESTS = 300
ANYIO_THREADS = 40  # AnyIO's default thread limiter: the most workers its pool keeps
POOLS = ("pagedkv-ssd-read", "pagedkv-render", "AnyIO worker thread")
KV_BUDGET_TOKENS = 2000


class Flaky:
    """Wraps a callable so that a seeded fraction of calls raises."""

    def __init__(self, fn: Any, rate: float, seed: int, what: str) -> None:
        self.fn, self.rate, self.rng, self.what = fn, rate, random.Random(seed), what
        self.lock = threading.Lock()
        self.failures = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            fail = self.rng.random() < self.rate
            self.failures += fail
        if fail:
            raise OSError(f"injected fault in {self.what}")
        return self.fn(*args, **kwargs)


@pytest.fixture
def served(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[str, Engine, list[Flaky]]]:
    probe = Engine.from_pretrained(str(tiny_llama_dir))
    per_token = probe.adapter.kv_bytes_per_token
    probe.close()
    config = CacheConfig(
        block_size=8,
        ram_cache_bytes=256 * 1024,  # a few hundred blocks: eviction happens
        kv_budget_bytes=KV_BUDGET_TOKENS * per_token,  # preemption happens
        ssd_cache_dir=tmp_path / "kv",
        ssd_cache_bytes=64 * 2**20,
    )
    engine = Engine.from_pretrained(
        str(tiny_llama_dir), config=config, scheduling=SchedulerConfig(max_num_seqs=8)
    )
    assert engine.prefix is not None
    ssd = engine.prefix.lower.tiers[0]
    faults = [
        Flaky(ssd.get, 0.15, 1, "the SSD tier's get"),
        Flaky(ssd.put, 0.15, 2, "the SSD tier's put"),
        Flaky(engine.prefix.ram.scatter, 0.05, 3, "the RAM store"),
    ]
    ssd.get, ssd.put = faults[0], faults[1]  # type: ignore[method-assign]
    engine.prefix.ram.scatter = faults[2]  # type: ignore[method-assign]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine, faults
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()
        sock.close()


def _one(url: str, i: int) -> str:
    rng = random.Random(i)
    shared = " ".join(f"w{j % 13}" for j in range(rng.choice([0, 30, 60])))
    body = {
        "prompt": f"{shared} request {i} " + "x " * rng.randrange(1, 40),
        "max_tokens": rng.randrange(1, 60),
        "temperature": rng.choice([0, 0.8]),
        "ignore_eos": True,
        "n": rng.choice([1, 1, 1, 2]),
    }
    mode = rng.choice(["whole", "stream", "disconnect", "disconnect-early"])
    with httpx.Client(base_url=url, timeout=60) as http:
        if mode == "whole":
            r = http.post("/v1/completions", json=body)
            return f"{r.status_code}"
        body["stream"] = True
        with http.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            stop_after = {"stream": 10**9, "disconnect": rng.randrange(1, 6), "disconnect-early": 0}
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    json.loads(line[6:])
                    seen += 1
                if seen > stop_after[mode]:
                    return "disconnected"  # leaving the block closes the connection
            return f"{r.status_code}"


def test_soak_leaves_nothing_held(served: tuple[str, Engine, list[Flaky]]) -> None:
    url, engine, faults = served
    process = psutil.Process()
    with ThreadPoolExecutor(12) as pool:  # a burst like the soak's: pools reach their size
        list(pool.map(lambda i: _one(url, -1 - i), range(24)))
    time.sleep(1)
    # Pools start their threads as work comes, up to a fixed size, and keep them: the
    # SSD tier's reads, the server's render pool (other apps' pools in this process
    # keep theirs too), AnyIO's workers. They are bounded by their sizes below; every
    # other thread must be gone (CI runs saw each pool start one more after this point).
    assert engine.prefix is not None
    reads = engine.prefix.lower.tiers[0].read_threads  # type: ignore[attr-defined]
    pooled_before = {prefix: _named(prefix) for prefix in POOLS}
    threads_before = _own_threads()
    names_before = collections.Counter(t.name for t in threading.enumerate())
    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(lambda i: _one(url, i), range(REQUESTS)))
    assert all(o in ("200", "disconnected") for o in outcomes), set(outcomes)
    assert sum(f.failures for f in faults) > 10, "the faults never fired: the soak tests nothing"
    deadline = time.monotonic() + 20
    while engine.num_active_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_active_requests() == 0
    assert engine.healthy
    stats = engine.cache_stats()
    assert stats.cache is not None and stats.scheduling is not None
    assert stats.cache.pool.allocated == 0, "blocks still held after the soak"
    assert stats.scheduling.kv_reserved_bytes == 0
    books = engine.accounting()
    assert books.balanced and books.pending_requests == 0, books
    assert stats.scheduling.cache_errors > 0
    assert engine.prefix is not None
    engine._call(engine.prefix.pool.check)
    with httpx.Client(base_url=url, timeout=60) as http:  # still serving, still exact
        body = {"prompt": "after the soak", "max_tokens": 5, "temperature": 0}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 20
    while _own_threads() > threads_before and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = collections.Counter(t.name for t in threading.enumerate())
    assert _own_threads() <= threads_before, f"new, still alive: {alive - names_before}"
    limits = {"pagedkv-ssd-read": reads, "pagedkv-render": DEFAULT_RENDER_THREADS}
    for prefix, before in pooled_before.items():
        assert _named(prefix) <= before + limits.get(prefix, ANYIO_THREADS), prefix
    assert process.num_threads() < 200


def _own_threads() -> int:
    """Threads alive, those of the pools in POOLS aside."""
    return sum(not t.name.startswith(POOLS) for t in threading.enumerate())


def _named(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())
