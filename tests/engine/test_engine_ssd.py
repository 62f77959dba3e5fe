"""The SSD tier under the engine: restarts, moved models, damaged files, crashes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from engine_helpers import BS, GREEDY, WORKER, random_prompt, reference_outputs

from pagedkv import CacheConfig, Engine, SamplingParams


def _cfg(ssd: Path, **kw: object) -> CacheConfig:
    return CacheConfig(block_size=BS, ssd_cache_dir=ssd, ssd_cache_bytes=64 * 2**20, **kw)  # type: ignore[arg-type]


def _block_files(ssd: Path) -> list[Path]:
    return sorted(ssd.rglob("*.safetensors"))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_restart_reuses_blocks_with_identical_output(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "kv"
    prompts = [random_prompt(1, 43), random_prompt(1, 43)[:30] + random_prompt(2, 11)]
    want = reference_outputs(tiny_llama_dir, prompts)
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        assert eng.generate(prompts[0], GREEDY).token_ids == want[0]
    assert _block_files(ssd), "nothing was written to the SSD tier"
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        first = eng.generate(prompts[0], GREEDY)
        second = eng.generate(prompts[1], GREEDY)
    assert first.token_ids == want[0] and second.token_ids == want[1]
    # prompt + answer but its last token was computed before: all of it comes back
    assert first.cached_tokens == len(prompts[0]) - 1
    assert first.tier_hits.get("ssd", 0) > 0
    assert second.cached_tokens == 30


def test_moved_model_hits_and_changed_weights_do_not(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "kv"
    prompt = random_prompt(3, 40)
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        eng.generate(prompt, GREEDY)
    moved = tmp_path / "elsewhere" / "model"
    shutil.copytree(tiny_llama_dir, moved)
    with Engine.from_pretrained(str(moved), config=_cfg(ssd)) as eng:
        assert eng.generate(prompt, GREEDY).cached_tokens == len(prompt) - 1
    import torch
    from safetensors.torch import load_file, save_file

    weights = moved / "model.safetensors"
    state = load_file(weights)
    name = next(k for k in state if "embed" in k)
    state[name] = state[name] + torch.randn_like(state[name]) * 0.1
    save_file(state, weights, metadata={"format": "pt"})
    with Engine.from_pretrained(str(moved), config=_cfg(ssd)) as eng:
        assert eng.generate(prompt, GREEDY).cached_tokens == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "garbage"])
def test_damaged_files_are_misses_and_go_away(
    tiny_llama_dir: Path, tmp_path: Path, damage: str
) -> None:
    ssd = tmp_path / "kv"
    prompt = random_prompt(4, 48)
    want = reference_outputs(tiny_llama_dir, [prompt])[0]
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        # one token: the KV on disk is exactly the prompt's 6 blocks, all read back below
        eng.generate(prompt, SamplingParams(max_tokens=1))
    victims = _block_files(ssd)
    assert len(victims) == len(prompt) // BS
    for victim in victims:
        if damage == "flip":
            data = bytearray(victim.read_bytes())
            data[-5] ^= 0x40
            victim.write_bytes(bytes(data))
        elif damage == "truncate":
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        elif damage == "delete":
            victim.unlink()
        else:
            victim.write_bytes(os.urandom(victim.stat().st_size))
    leftover = victims[0].parent / (victims[0].name + f".tmp-{_dead_pid()}-abc")
    leftover.write_bytes(b"half a block")
    aged = time.time() - 3700  # a pid-named (pre-lock) temporary is stale after an hour
    os.utime(leftover, (aged, aged))
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        r = eng.generate(prompt, GREEDY)
        ssd_stats = eng.cache_stats().cache.tiers["ssd"]
    assert r.token_ids == want
    assert r.cached_tokens == 0
    assert not leftover.exists()
    if damage != "delete":
        assert ssd_stats.corrupt > 0
    # every file left (rewritten by the run above) verifies: the bad ones are gone
    check = _cli("cache", "check", "--ssd-cache-dir", str(ssd))
    assert check.returncode == 0, check.stdout + check.stderr


def test_kill_9_during_heavy_writes_then_check_is_clean(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    ssd = tmp_path / "kv"
    prompts = [random_prompt(100 + i, 150) for i in range(40)]
    spec = {
        "model": str(tiny_llama_dir),
        "prompts": prompts,
        "max_tokens": 2,
        "cache": {"block_size": BS, "ssd_cache_dir": str(ssd), "ssd_cache_bytes": 64 * 2**20},
    }
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(spec)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for _ in range(6):  # let it write for a while
        proc.stdout.readline()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert _block_files(ssd)
    want = reference_outputs(tiny_llama_dir, prompts[:3])
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        got = [eng.generate(p, GREEDY).token_ids for p in prompts[:3]]
    assert got == want
    check = _cli("cache", "check", "--ssd-cache-dir", str(ssd))
    assert check.returncode == 0, check.stdout + check.stderr


def test_two_processes_share_one_directory(tiny_llama_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "kv"
    shared = random_prompt(7, 40)
    prompts = [shared + random_prompt(8 + i, 10) for i in range(4)]
    spec = {
        "model": str(tiny_llama_dir),
        "prompts": prompts,
        "max_tokens": 8,
        "cache": {"block_size": BS, "ssd_cache_dir": str(ssd), "ssd_cache_bytes": 64 * 2**20},
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    want = reference_outputs(tiny_llama_dir, prompts)
    for out, _ in outs:
        results = [json.loads(line) for line in out.splitlines() if '"token_ids"' in line]
        assert [r["token_ids"] for r in results] == want
    check = _cli("cache", "check", "--ssd-cache-dir", str(ssd))
    assert check.returncode == 0, check.stdout + check.stderr
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        assert eng.generate(prompts[2], GREEDY).cached_tokens == len(prompts[2]) - 1


def test_library_default_writes_nothing_to_disk(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_HOME", str(tmp_path / "home"))
    with Engine.from_pretrained(str(tiny_llama_dir), config=CacheConfig(block_size=BS)) as eng:
        eng.generate(random_prompt(9, 30), GREEDY)
        assert "ssd" not in eng.cache_stats().cache.tiers
    assert not (tmp_path / "home" / "kv").exists()


def test_a_failing_lower_tier_costs_a_recompute_not_the_request(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ssd = tmp_path / "kv"
    prompt = random_prompt(11, 40)
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        eng.generate(prompt, GREEDY)
    with Engine.from_pretrained(str(tiny_llama_dir), config=_cfg(ssd)) as eng:
        assert eng.prefix is not None
        tier = eng.prefix.lower.tiers[0]

        def broken(hashes: list[bytes], *on_block: object) -> list[object]:
            raise RuntimeError("disk on fire")

        monkeypatch.setattr(tier, "get", broken)
        monkeypatch.setattr(tier, "get_each", broken)
        degraded = eng.generate(prompt, GREEDY)
        assert degraded.cached_tokens == 0
        assert degraded.token_ids == reference_outputs(tiny_llama_dir, [prompt])[0]
        assert eng.cache_stats().cache.pool.allocated == 0, "the failed lookup leaked blocks"
        # The lower-tier walk takes a raising tier as a miss (counted there), so the
        # request never reaches the worker's catch-all.
        assert eng.prefix.lower.failures >= 1
        assert eng.cache_stats().scheduling.cache_errors == 0
        monkeypatch.undo()
        assert eng.generate(prompt, GREEDY).cached_tokens == len(prompt) - 1
