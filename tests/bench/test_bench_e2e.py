"""`pagedkv bench` end to end on a tiny random model: results.json, the plot, full reuse."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.bench.run import main
from pagedkv.cli import build_parser

FIELDS = {
    "workload", "model", "requests", "ttft_cold_median_s", "ttft_cold_p90_s",
    "ttft_cached_median_s", "ttft_cached_p90_s", "speedup", "reused_tokens",
    "ideal_reused_tokens", "reuse_ratio", "tier_hits", "generated_tokens_per_s", "wall_s",
}  # fmt: skip


def _args(model: Path, out: Path, ssd: Path, *workloads: str) -> object:
    argv = [
        "bench",
        "--model",
        str(model),
        "--out",
        str(out),
        "--block-size",
        "8",
        "--ram-cache",
        "64MB",
        "--ssd-cache-dir",
        str(ssd),
        "--seed",
        "1",
    ]
    for w in workloads:
        argv += ["--workload", w]
    args = build_parser().parse_args(argv)
    args.size = "tiny"  # smaller than --quick: a tiny model has a tiny vocabulary
    return args


def test_bench_writes_results_and_reuses_what_an_ideal_cache_would(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, ssd = tmp_path / "out", tmp_path / "ssd"
    assert main(_args(tiny_llama_dir, out, ssd)) == 0  # type: ignore[arg-type]

    results = json.loads((out / "results.json").read_text())
    assert [r["workload"] for r in results] == ["chat", "agent", "shared-prefix", "restart"]
    for r in results:
        assert r.keys() >= FIELDS
        assert r["requests"] == len(r["per_request"]) > 0
        assert r["ideal_reused_tokens"] > 0
        target = 0.95 if r["workload"] == "restart" else 0.98
        assert r["reuse_ratio"] >= target, r["workload"]
        assert r["reused_tokens"] <= r["ideal_reused_tokens"], "reused KV the ideal never saw"
        assert r["cold_reused_tokens"] == 0
        assert r["outputs_identical"] == r["outputs_compared"] == r["requests"]
        assert r["ttft_cold_median_s"] > 0 and r["ttft_cached_median_s"] > 0
    restart = results[-1]
    assert restart["tier_hits"].get("ssd", 0) > 0, "after the restart, prefixes come from SSD"
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report.html").read_text().count("<svg") == 3
    assert not any(ssd.iterdir()), "the bench's temporary SSD directory is removed"

    table = capsys.readouterr().out
    for name in ("chat", "agent", "shared-prefix", "restart", "reused/ideal"):
        assert name in table


def test_bench_refuses_to_run_without_the_cache(tiny_llama_dir: Path, tmp_path: Path) -> None:
    args = _args(tiny_llama_dir, tmp_path / "out", tmp_path / "ssd", "chat")
    args.no_prefix_cache = True  # type: ignore[attr-defined]
    assert main(args) == 2  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def server_url(tiny_llama_dir: Path) -> Iterator[str]:
    """A real pagedkv server for the tiny model on 127.0.0.1, in a thread."""
    import uvicorn

    from pagedkv import CacheConfig, Engine
    from pagedkv.server.app import create_app

    engine = Engine.from_pretrained(
        str(tiny_llama_dir), config=CacheConfig(block_size=8, ram_cache_bytes=64 * 2**20)
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(engine), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.close()
        sock.close()


def test_bench_through_an_openai_compatible_server(
    tiny_llama_dir: Path, tmp_path: Path, server_url: str
) -> None:
    out = tmp_path / "out"
    args = _args(tiny_llama_dir, out, tmp_path / "ssd", "chat", "shared-prefix", "restart")
    args.url = server_url  # type: ignore[attr-defined]
    assert main(args) == 0  # type: ignore[arg-type]

    results = json.loads((out / "results.json").read_text())
    assert [r["workload"] for r in results] == ["chat", "shared-prefix"], "restart is skipped"
    for r in results:
        assert r.keys() >= FIELDS and r["mode"] == "url"
        assert r["cold_reused_tokens"] == 0, "a fresh cache_salt per cold request reuses nothing"
        assert r["reused_tokens"] > 0
        assert r["ideal_reused_tokens"] is not None
        assert r["reuse_ratio"] >= 0.9, r
    assert (out / "results.png").is_file()


@pytest.mark.parametrize("remote", [False, True])
def test_bench_with_several_users_at_once(
    tiny_llama_dir: Path, tmp_path: Path, server_url: str, remote: bool
) -> None:
    out = tmp_path / "out"
    args = _args(tiny_llama_dir, out, tmp_path / "ssd", "chat", "restart")
    args.concurrency = 3  # type: ignore[attr-defined]
    if remote:
        args.url = server_url  # type: ignore[attr-defined]
    assert main(args) == 0  # type: ignore[arg-type]
    results = json.loads((out / "results.json").read_text())
    for r in results:
        assert r["concurrency"] == 3
        assert r["requests"] == len(r["per_request"]) > 0
        assert r["reused_tokens"] > 0 and r["reuse_ratio"] >= 0.8, r
        assert r["generated_tokens_per_s"] > 0
        if not remote:  # the ideal is exact locally, an estimate through the API
            assert r["reused_tokens"] <= r["ideal_reused_tokens"], "reused KV the ideal never saw"
            assert r["outputs_identical"] == r["outputs_compared"] == r["requests"]


def test_bench_through_the_anthropic_route_reuses_as_much_as_the_openai_one(
    tiny_llama_dir: Path, tmp_path: Path, server_url: str
) -> None:
    figures = {}
    for api in ("openai", "anthropic"):
        out = tmp_path / api
        args = _args(tiny_llama_dir, out, tmp_path / "ssd", "chat", "shared-prefix")
        args.url = server_url  # type: ignore[attr-defined]
        args.api = api  # type: ignore[attr-defined]
        assert main(args) == 0  # type: ignore[arg-type]
        results = json.loads((out / "results.json").read_text())
        assert all(r["api"] == api and r["cold_reused_tokens"] == 0 for r in results)
        figures[api] = [
            (r["workload"], r["prompt_tokens"], r["reused_tokens"], r["miss_reasons"])
            for r in results
        ]
        # Every request is accounted for: a hit, or the cause of its first miss.
        for r in results:
            assert sum(r["miss_reasons"].values()) == r["requests"]
            assert r["miss_reasons"].get("new", 0) >= 1  # the first turn of a session
            assert r["miss_reasons"].get("evicted", 0) == 0  # 64 MiB: nothing leaves
    # Same conversations, greedy: the same prompts, the same reuse, the same causes.
    assert figures["anthropic"] == figures["openai"]


def test_bench_on_the_mlx_backend_reuses_what_an_ideal_cache_would(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """`pagedkv bench --backend mlx`: the chat and agent workloads reuse >= 0.98 of ideal."""
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'pagedkv[mlx]'")
    out, ssd = tmp_path / "out", tmp_path / "ssd"
    args = _args(tiny_llama_dir, out, ssd, "chat", "agent")
    args.backend = "mlx"  # type: ignore[attr-defined]
    assert main(args) == 0  # type: ignore[arg-type]
    results = json.loads((out / "results.json").read_text())
    assert [r["workload"] for r in results] == ["chat", "agent"]
    for r in results:
        assert r["reuse_ratio"] >= 0.98, r["workload"]
