"""The start-up banner of `pagedkv serve` says what a user set: every name the model
answers to, and no SSD tier when `--no-ssd-cache` turned it off."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from fixtures_models import make_tiny_model
from server_proc import URL_RE, ServerProc


def _banner(args: list[str], home: Path, timeout: float = 90.0) -> str:
    """Start `pagedkv serve` on a free port, stop it once it listens; its log so far."""
    log_fd, log_name = tempfile.mkstemp(prefix="pagedkv-banner-", suffix=".log")
    env = {**os.environ, "PAGEDKV_CACHE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=log_fd, stderr=subprocess.STDOUT, env=env)
    os.close(log_fd)
    log_path = Path(log_name)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            text = log_path.read_text(errors="replace")
            match = URL_RE.search(text)
            if match:
                assert ServerProc(proc, match.group(1), log_path).stop() == 0
                return text
            time.sleep(0.05)
        raise AssertionError(f"the server did not start:\n{log_path.read_text()}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log_path.unlink(missing_ok=True)


def _banner_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "pagedkv.server.serve:" in line]


@pytest.mark.slow
def test_banner_without_ssd_lists_no_ssd_tier_and_every_served_name(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny-banner", arch="llama")
    args = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--no-ssd-cache"]
    args += ["--ram-cache", "32MB", "--served-model-name", "gpt-4o-mini"]
    args += ["--served-model-name", "house-model"]
    lines = _banner_lines(_banner(args, tmp_path / "home"))
    model_line = next(line for line in lines if "(context" in line)
    assert "model tiny-banner (context" in model_line
    assert model_line.endswith("requests may name it gpt-4o-mini, house-model, tiny-banner")
    assert not [line for line in lines if "ssd" in line.lower()]
    assert any("cache: tier ram:" in line for line in lines)
    assert any("RAM only, nothing is kept on disk" in line for line in lines)
    assert not (tmp_path / "home" / "kv").exists()  # and indeed nothing was written there


@pytest.mark.slow
def test_banner_with_the_default_ssd_tier_names_where(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny-banner", arch="llama")
    args = ["--model", str(model), "--device", "cpu", "--dtype", "float32"]
    args += ["--ram-cache", "32MB", "--ssd-cache", "64MB"]
    lines = _banner_lines(_banner(args, tmp_path / "home"))
    ssd = [line for line in lines if "tier ssd" in line]
    assert len(ssd) == 1 and str(tmp_path / "home" / "kv") in ssd[0]
    assert not any("RAM only" in line for line in lines)
    assert any(line.endswith("requests may name it tiny-banner") for line in lines)
