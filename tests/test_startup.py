"""`pagedkv serve` that cannot start says why in one paragraph, with no traceback, and
finds a port in use before it loads the model (`pagedkv/startup.py`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

MAIN = "import sys; from pagedkv.cli import main; sys.exit(main())"
LOADED = "layers of "  # the engine's log line once the model is loaded (engine/engine.py)


def serve(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env = {k: v for k, v in env.items() if not k.startswith("PAGEDKV_")}
    cmd = [sys.executable, "-c", MAIN, "serve", "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def busy_port() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def one_paragraph(proc: subprocess.CompletedProcess[str]) -> str:
    """The error paragraph of a failed `pagedkv serve`; checks there is no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pagedkv serve: error")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_a_port_in_use_fails_before_the_model_loads(tiny_llama_dir: Path, busy_port: int) -> None:
    proc = serve("--model", str(tiny_llama_dir), "--port", str(busy_port), "--no-ssd-cache")
    assert proc.returncode == 1
    message = one_paragraph(proc)
    assert f"cannot listen on 127.0.0.1:{busy_port}" in message
    assert "--port" in message, "says what to do"
    assert LOADED not in proc.stderr, "the port is checked before the model is loaded"


def test_a_model_that_does_not_exist(tmp_path: Path) -> None:
    proc = serve("--model", str(tmp_path / "no-such-model"), "--port", "0", "--no-ssd-cache")
    assert proc.returncode == 1
    assert "cannot load model" in one_paragraph(proc)


@pytest.mark.parametrize("problem", ["a file", "writable by others"])
def test_a_bad_ssd_cache_dir(tiny_llama_dir: Path, tmp_path: Path, problem: str) -> None:
    where = tmp_path / "kv"
    if problem == "a file":
        where.write_text("not a directory")
    else:
        where.mkdir()
        where.chmod(0o777)
    proc = serve("--model", str(tiny_llama_dir), "--port", "0", "--ssd-cache-dir", str(where))
    assert proc.returncode == 1
    message = one_paragraph(proc)
    assert f"refusing SSD cache directory {where}" in message
    assert LOADED not in proc.stderr, "the directory is checked before the model is loaded"


def test_bad_flag_values_are_usage_errors(tiny_llama_dir: Path) -> None:
    model = ["--model", str(tiny_llama_dir), "--port", "0", "--no-ssd-cache"]
    proc = serve(*model, "--redis-url", "localhost:6379")
    assert proc.returncode == 2
    assert "--redis-url 'localhost:6379' is not a Redis URL" in one_paragraph(proc)
    proc = serve(*model, "--ram-cache", "lots")
    assert proc.returncode == 2
    assert "cannot read size 'lots'" in one_paragraph(proc)


def test_a_missing_cache_secret_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    proc = serve(
        "--model", str(tiny_llama_dir), "--port", "0", "--ssd-cache-dir", str(tmp_path / "kv"),
        "--cache-secret-file", str(secret),
    )  # fmt: skip
    assert proc.returncode == 1
    assert f"cannot read the cache secret file {secret}" in one_paragraph(proc)


def test_debug_still_shows_the_traceback(tmp_path: Path) -> None:
    proc = serve(
        "--model", str(tmp_path / "no-such-model"), "--port", "0", "--no-ssd-cache",
        "--log-level", "debug",
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert "ModelNotSupportedError" in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("pagedkv serve: error: cannot load")
