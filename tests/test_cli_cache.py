"""`pagedkv cache stats | clear` on a directory two real engines wrote: stats names each
namespace's model and dtype, clear asks first, clears one model, and leaves a
directory a running engine holds alone unless forced."""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fixtures_models import make_tiny_model

from pagedkv import CacheConfig, Engine, SamplingParams
from pagedkv.storage.ssd import cache_stats

PROMPT = "the quick brown fox jumps over the lazy dog " * 4


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """An SSD directory holding blocks of two tiny models, and the models' directories."""
    root = tmp_path_factory.mktemp("cli-cache")
    models = {
        "tiny-llama": make_tiny_model(root / "tiny-llama", arch="llama"),
        "tiny-qwen": make_tiny_model(root / "tiny-qwen", arch="qwen2", seed=1),
    }
    kv = root / "kv"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDKV_CACHE_HOME", str(root / "home"))
        for model_dir in models.values():
            config = CacheConfig(block_size=16, ram_cache_bytes=32 << 20, ssd_cache_dir=kv)
            engine = Engine.from_pretrained(
                str(model_dir), config=config, device="cpu", dtype="float32"
            )
            try:
                engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0))
            finally:
                engine.close()
    return {"kv": kv, "models": models, "home": root / "home"}


@pytest.fixture
def kv(written: dict[str, object], tmp_path: Path) -> Path:
    """A fresh copy of the written directory (tests clear it)."""
    copy = tmp_path / "kv"
    shutil.copytree(written["kv"], copy, ignore=shutil.ignore_patterns("locks"))  # type: ignore[arg-type]
    return copy


def _namespaces_by_model(kv: Path) -> dict[str, str]:
    stats = cache_stats(kv)
    return {info.model: ns for ns, info in stats.descriptions.items() if info is not None}


def cache(*args: str, stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "cache", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=stdin,
    )


def test_stats_names_each_namespace_model_and_dtype(kv: Path) -> None:
    out = cache("stats", "--ssd-cache-dir", str(kv))
    assert out.returncode == 0, out.stderr
    by_model = _namespaces_by_model(kv)
    assert set(by_model) == {"tiny-llama", "tiny-qwen"}
    lines = out.stdout.splitlines()
    for model, ns in by_model.items():
        line = next(x for x in lines if ns in x)
        assert f"{model} (float32, KV float32, block 16 tokens)" in line
    # a namespace whose description is gone (written by an older pagedkv) says so
    (kv / "namespaces" / f"{by_model['tiny-qwen']}.json").unlink()
    lines = cache("stats", "--ssd-cache-dir", str(kv)).stdout.splitlines()
    line = next(x for x in lines if by_model["tiny-qwen"] in x)
    assert "unknown model (written before this version)" in line


def test_stats_json_carries_the_descriptions(kv: Path) -> None:
    import json

    out = json.loads(cache("stats", "--json", "--ssd-cache-dir", str(kv)).stdout)
    models = {d["model"]: d for d in out["descriptions"].values()}
    assert set(models) == {"tiny-llama", "tiny-qwen"}
    assert models["tiny-llama"]["dtype"] == "float32" and models["tiny-llama"]["block_size"] == 16
    assert models["tiny-llama"]["weights"].startswith("files:")


def test_clear_without_a_terminal_or_yes_refuses(kv: Path) -> None:
    before = cache_stats(kv).num_blocks
    out = cache("clear", "--ssd-cache-dir", str(kv))
    assert out.returncode == 1
    assert "not a terminal" in out.stderr and "--yes" in out.stderr
    assert cache_stats(kv).num_blocks == before > 0
    out = cache("clear", "--yes", "--ssd-cache-dir", str(kv))
    assert out.returncode == 0, out.stderr
    assert f"removed {before} blocks" in out.stdout
    assert cache_stats(kv).num_blocks == 0


def test_clear_on_a_terminal_asks_first(kv: Path) -> None:
    before = cache_stats(kv).num_blocks
    for answer, removed in (("n", False), ("y", True)):
        leader, follower = pty.openpty()
        try:
            os.write(leader, f"{answer}\n".encode())
            out = cache("clear", "--ssd-cache-dir", str(kv), stdin=follower)
        finally:
            os.close(leader)
            os.close(follower)
        assert "Delete them? [y/N]" in out.stdout
        assert "tiny-llama (float32" in out.stdout and "tiny-qwen (float32" in out.stdout
        assert out.returncode == (0 if removed else 1)
        assert cache_stats(kv).num_blocks == (0 if removed else before)


def test_clear_model_clears_only_that_models_namespaces(
    kv: Path, written: dict[str, object]
) -> None:
    models: dict[str, Path] = written["models"]  # type: ignore[assignment]
    by_model = _namespaces_by_model(kv)
    kept = cache_stats(kv).namespaces[by_model["tiny-qwen"]].num_blocks
    llama = ("--model", str(models["tiny-llama"]), "--ssd-cache-dir", str(kv))
    out = cache("clear", "--yes", *llama)
    assert out.returncode == 0, out.stderr
    stats = cache_stats(kv)
    assert set(stats.namespaces) == {by_model["tiny-qwen"]}
    assert stats.namespaces[by_model["tiny-qwen"]].num_blocks == kept > 0
    again = cache(
        "clear", "--yes", "--model", str(models["tiny-llama"]), "--ssd-cache-dir", str(kv)
    )
    assert again.returncode == 1 and "no blocks of tiny-llama" in again.stderr
    bad = cache("clear", "--yes", "--model", str(kv / "nothing"), "--ssd-cache-dir", str(kv))
    assert bad.returncode == 1 and "cannot load model" in bad.stderr
    out = cache("clear", "--yes", "--namespace", by_model["tiny-qwen"], "--ssd-cache-dir", str(kv))
    assert out.returncode == 0 and cache_stats(kv).num_blocks == 0


HOLDER = """
import sys
from pagedkv.storage.ssd import SSDStore
store = SSDStore(sys.argv[1], 1 << 30, "holder")
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


@pytest.fixture
def held(kv: Path) -> Iterator[Path]:
    """`kv` while another process has an SSD store open on it (a server would)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(kv)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield kv
    finally:
        proc.kill()
        proc.wait(30)


def test_clear_refuses_while_an_engine_holds_the_directory(held: Path) -> None:
    before = cache_stats(held).num_blocks
    assert cache_stats(held).live_writers == 1
    out = cache("clear", "--yes", "--ssd-cache-dir", str(held))
    assert out.returncode == 1
    assert "running engine" in out.stderr and "--force" in out.stderr
    assert cache_stats(held).num_blocks == before > 0
    assert "in use by 1 running engine" in cache("stats", "--ssd-cache-dir", str(held)).stdout
    out = cache("clear", "--yes", "--force", "--ssd-cache-dir", str(held))
    assert out.returncode == 0, out.stderr
    assert cache_stats(held).num_blocks == 0


def test_a_dead_engines_lock_does_not_hold_the_directory(kv: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", HOLDER.replace("store.close()", "import os; os._exit(0)"), str(kv)],
        input="",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "ready"
    assert cache_stats(kv).live_writers == 0
    assert cache("clear", "--yes", "--ssd-cache-dir", str(kv)).returncode == 0
