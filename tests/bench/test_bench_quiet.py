"""`pagedkv bench --url` keeps httpx's per-request log lines out of its progress bar."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.bench.run import main
from pagedkv.cli import build_parser


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


def test_bench_url_logs_no_line_per_http_request(
    tiny_llama_dir: Path, tmp_path: Path, server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["bench", "--model", str(tiny_llama_dir), "--url", server_url, "--workload", "chat"]
    args = build_parser().parse_args(argv)
    args.size = "tiny"
    caplog.set_level(logging.INFO)
    assert main(args) == 0
    assert not [r for r in caplog.records if r.name.startswith("httpx")], "httpx's lines"
    # Put back afterwards: outside the bench, httpx logs as the application configured it.
    assert logging.getLogger("httpx").level == logging.getLogger("httpx2").level == logging.NOTSET
