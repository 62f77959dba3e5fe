"""A real pagedkv server in a subprocess on 127.0.0.1, for the server tests.

Imported by the tests (`start_server`, `ServerProc`, fixtures); run as a script
it is the launcher: it loads a model into a real `pagedkv.Engine` and calls
`run_server` on port 0, and the parent reads the URL from its log.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest

HERE = Path(__file__).resolve()
URL_RE = re.compile(r"serving on (http://127\.0\.0\.1:\d+)")


class ServerProc:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, api_key: str = "none", **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)  # type: ignore[arg-type]

    def http(self, api_key: str | None = None, timeout: float = 30.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 25.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(
    model_dir: str | Path,
    *,
    api_keys: Sequence[str] = (),
    admin_keys: Sequence[str] = (),
    args: Sequence[str] = (),
    timeout: float = 90.0,
) -> ServerProc:
    """Launch the server and wait until it listens; raises with its log if it dies."""
    log_fd, log_name = tempfile.mkstemp(prefix="pagedkv-server-", suffix=".log")
    cmd = [sys.executable, str(HERE), "--model", str(model_dir), *args]
    cmd += [x for key in api_keys for x in ("--api-key", key)]
    cmd += [x for key in admin_keys for x in ("--admin-key", key)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, env=env)
    os.close(log_fd)
    log_path = Path(log_name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = URL_RE.search(log_path.read_text(errors="replace"))
        if match:
            return ServerProc(proc, match.group(1), log_path)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the server did not start:\n{log_path.read_text(errors='replace')}")


def make_server_model(path: Path, context: int) -> Path:
    from fixtures_models import make_tiny_model

    return make_tiny_model(path, arch="llama", max_position_embeddings=context)


@pytest.fixture(scope="module")
def server_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a 4096-token context (long enough to stream for seconds)."""
    return make_server_model(tmp_path_factory.mktemp("server-model") / "tiny", 4096)


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a Hermes-style chat template that renders tools."""
    from fixtures_models import TOOLS_CHAT_TEMPLATE, make_tiny_model

    path = tmp_path_factory.mktemp("server-model-tools") / "tiny"
    return make_tiny_model(path, arch="llama", chat_template=TOOLS_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def small_context_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same tiny Llama with a 64-token context, so no request runs long (fuzzing)."""
    return make_server_model(tmp_path_factory.mktemp("server-model-64") / "tiny", 64)


def running(server: ServerProc) -> Iterator[ServerProc]:
    """Yield the server; on teardown stop it and check it exited cleanly."""
    try:
        yield server
    finally:
        rc = server.stop()
        assert rc == 0, f"server exited with {rc}:\n{server.log()[-4000:]}"
        server.log_path.unlink(missing_ok=True)


def main() -> int:
    from pagedkv import CacheConfig, Engine
    from pagedkv.server import run_server

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--api-key", action="append", default=[])
    p.add_argument("--admin-key", action="append", default=[])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--ram-cache", default="64MB")
    p.add_argument("--ssd-cache-dir", default=None)
    p.add_argument("--max-leased-fraction", type=float, default=0.5)
    p.add_argument("--max-queue", type=int, default=64)
    p.add_argument("--max-body-bytes", type=int, default=1024 * 1024)
    p.add_argument("--drain-timeout", type=float, default=5.0)
    p.add_argument("--reasoning-cache", default="auto")
    p.add_argument("--max-requests-per-key", type=int, default=None)
    # Passed on only when given, so that a test of an older run_server fails on its
    # behaviour rather than on an unknown keyword.
    limits: dict[str, type] = {
        "max_connections": int,
        "max_connections_per_client": int,
        "header_timeout": float,
        "receive_timeout": float,
    }
    for name, kind in limits.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    p.add_argument("--metrics-key", action="append", default=[])
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--snapshot-interval-blocks", type=int, default=1)
    a = p.parse_args()
    extra = {name: getattr(a, name) for name in limits if getattr(a, name) is not None}
    if a.metrics_key:
        extra["metrics_keys"] = a.metrics_key
    cache = CacheConfig(
        block_size=a.block_size,
        ram_cache_bytes=a.ram_cache,
        ssd_cache_dir=a.ssd_cache_dir,
        kv_dtype=a.kv_dtype,
        snapshot_interval_blocks=a.snapshot_interval_blocks,
        reasoning_cache=a.reasoning_cache,
        max_leased_fraction=a.max_leased_fraction,
    )
    if a.max_requests_per_key is not None:
        extra["max_requests_per_key"] = a.max_requests_per_key
    engine = Engine.from_pretrained(
        a.model, config=cache, device="cpu", dtype="float32", max_queue=a.max_queue
    )
    return run_server(
        engine,
        port=0,
        api_keys=a.api_key,
        admin_keys=a.admin_key or None,
        max_body_bytes=a.max_body_bytes,
        drain_timeout=a.drain_timeout,
        log_level="info",
        **extra,
    )


if __name__ == "__main__":
    sys.exit(main())
