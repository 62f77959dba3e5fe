"""The command line: flags, their PAGEDKV_* variables, generate and cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import cli


def _parse(*argv: str) -> object:
    return cli.build_parser().parse_args(list(argv))


def test_cache_flags_and_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDKV_RAM_CACHE", "512MB")
    monkeypatch.setenv("PAGEDKV_SSD_CACHE_DIR", str(tmp_path / "kv"))
    monkeypatch.setenv("PAGEDKV_BLOCK_SIZE", "32")
    cfg = cli.cache_config_from_args(_parse("serve", "--ssd-cache", "2GiB"))  # type: ignore[arg-type]
    assert cfg.ram_cache_bytes == 512 * 10**6
    assert cfg.ssd_cache_dir == tmp_path / "kv" and cfg.ssd_cache_bytes == 2 * 2**30
    assert cfg.block_size == 32 and cfg.enable_prefix_caching
    # a flag on the command line wins over the environment
    assert cli.cache_config_from_args(_parse("serve", "--block-size", "16")).block_size == 16  # type: ignore[arg-type]


def test_ssd_tier_is_on_by_default_in_the_cli_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_HOME", str(tmp_path))
    cfg = cli.cache_config_from_args(_parse("generate", "hi"))  # type: ignore[arg-type]
    assert cfg.ssd_cache_dir == tmp_path / "kv"
    assert (
        cli.cache_config_from_args(_parse("generate", "--no-ssd-cache", "hi")).ssd_cache_dir is None
    )  # type: ignore[arg-type]


def test_redis_cluster_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "redis://127.0.0.1:7000/0"
    cfg = cli.cache_config_from_args(_parse("serve", "--redis-url", url))  # type: ignore[arg-type]
    assert cfg.redis_url == url and not cfg.redis_cluster
    cfg = cli.cache_config_from_args(_parse("serve", "--redis-url", url, "--redis-cluster"))  # type: ignore[arg-type]
    assert cfg.redis_cluster
    monkeypatch.setenv("PAGEDKV_REDIS_CLUSTER", "1")
    assert cli.cache_config_from_args(_parse("serve", "--redis-url", url)).redis_cluster  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="redis_cluster needs redis_url"):
        cli.cache_config_from_args(_parse("serve"))  # type: ignore[arg-type]


def test_bad_sizes_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="512MB or 4GiB"):
        cli.cache_config_from_args(_parse("serve", "--ram-cache", "lots"))  # type: ignore[arg-type]


def test_generate_then_cache_commands(tiny_llama_dir: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    cmd = [
        sys.executable,
        "-m",
        "pagedkv.cli",
        "generate",
        "--model",
        str(tiny_llama_dir),
        "--ssd-cache-dir",
        str(kv),
        "--max-tokens",
        "5",
        "hello there, how are you",
    ]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert "cached tokens: 0" in first.stderr and "TTFT" in first.stderr
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert second.stdout == first.stdout
    assert "cached tokens: 0" not in second.stderr  # restored from the SSD tier
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "pagedkv.cli", "cache", *a, "--ssd-cache-dir", str(kv)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    stats = run("stats", "--json")
    assert stats.returncode == 0 and '"num_blocks"' in stats.stdout
    per_token = json.loads(stats.stdout)["bytes_per_token"]
    assert len(per_token) == 1 and 512 < next(iter(per_token.values())) < 1024  # float32 KV
    assert run("check").returncode == 0
    assert "removed" in run("clear", "--yes").stdout
    assert '"num_blocks": 0' in run("stats", "--json").stdout
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv.cli",
            "cache",
            "check",
            "--ssd-cache-dir",
            str(tmp_path / "nothing"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "no SSD cache" in missing.stderr
