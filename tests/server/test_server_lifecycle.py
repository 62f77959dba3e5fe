"""Start-up log and SIGTERM shutdown of a real server subprocess with a stream in flight."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_proc import server_model_dir, start_server

from pagedkv.storage.ssd.maintenance import cache_stats

pytestmark = pytest.mark.slow
__all__ = ["server_model_dir"]  # a fixture, used by name


def test_sigterm_cancels_streams_closes_the_engine_and_exits_0(
    server_model_dir: Path, tmp_path: Path
) -> None:
    ssd = tmp_path / "kv"
    # A drain well inside the stream's life: the tiny model decodes these 3500 tokens in ~3 s.
    args = ["--drain-timeout", "0.25", "--ssd-cache-dir", str(ssd)]
    server = start_server(server_model_dir, args=args)
    prompt = "a long story about caches " * 20  # several full 16-token blocks
    try:
        log = server.log()
        assert "model tiny (context 4096 tokens)" in log
        assert "cache: tier ram: 0.0 MiB used of 61.0 MiB" in log  # 64 MB
        assert "cache: tier ssd: 0.0 MiB used of" in log
        assert f"serving on {server.url}" in log
        assert f"try: curl {server.url}/v1/chat/completions" in log

        started = threading.Event()
        lines: list[str] = []

        def consume() -> None:
            body = {
                "prompt": prompt,
                "max_tokens": 3500,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
            }
            with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) >= 3:
                        started.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(30), server.log()
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(25)
        elapsed = time.monotonic() - t0
        reader.join(5)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = server.log()
    assert rc == 0, log[-3000:]
    assert elapsed < 20, log[-3000:]
    assert lines[-1] == "data: [DONE]"
    events: list[dict[str, Any]] = [json.loads(x[6:]) for x in lines[:-1]]
    assert events[-1]["error"]["code"] == "request_cancelled"  # drained for 0.25 s, then cancelled
    generated = sum(1 for e in events if "choices" in e)
    assert 3 <= generated < 3500
    assert "cancelled 1 requests still running" in log
    assert "engine closed" in log
    assert "Traceback" not in log
    # The prompt's blocks, cached right after prefill, reached the disk before the exit.
    assert cache_stats(ssd).num_blocks >= 8  # of the ~16 full blocks of the prompt
    server.log_path.unlink(missing_ok=True)


def test_sigint_on_an_idle_server_exits_0_quickly(server_model_dir: Path) -> None:
    server = start_server(server_model_dir)
    try:
        with server.http() as http:
            assert http.get("/health").json()["status"] == "ok"
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        rc = server.proc.wait(25)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert rc == 0, server.log()[-3000:]
    assert time.monotonic() - t0 < 10
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
    server.log_path.unlink(missing_ok=True)
