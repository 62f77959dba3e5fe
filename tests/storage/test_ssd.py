"""SSD store at the tier level: real SQLite files, real block files, injected and real faults."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from ssd_worker import NAMESPACE, block_hash, make_block, same_block

from pagedkv.storage.base import block_checksum
from pagedkv.storage.ssd import io as ssd_io
from pagedkv.storage.ssd import writer as ssd_writer
from pagedkv.storage.ssd.format import decode_file, encode_file, file_size
from pagedkv.storage.ssd.io import read_file
from pagedkv.storage.ssd.store import SSDStore, cache_stats, check_cache, clear_cache
from pagedkv.storage.ssd.versions import block_path

WORKER = Path(__file__).with_name("ssd_worker.py")
MiB = 1024**2


def _file_bytes(block) -> int:
    """Size of a block's file: what capacity counts."""
    return file_size(*encode_file(block, block_checksum(block)))


@pytest.fixture
def open_stores() -> Iterator[list[SSDStore]]:
    stores: list[SSDStore] = []
    yield stores
    for store in stores:
        store.close(timeout=2)


@pytest.fixture
def new_store(tmp_path: Path, open_stores: list[SSDStore]):
    def make(directory: Path | None = None, capacity: int = 64 * MiB, **kwargs) -> SSDStore:
        kwargs.setdefault("namespace", NAMESPACE)
        store = SSDStore(directory or tmp_path / "kv", capacity, **kwargs)
        open_stores.append(store)
        return store

    return make


def _stall_writes(monkeypatch, gate: threading.Event) -> None:
    """Make the writer thread wait on `gate` before each file it writes."""
    real = ssd_writer.write_temp

    def stalled(*args):
        assert gate.wait(30)
        return real(*args)

    monkeypatch.setattr(ssd_writer, "write_temp", stalled)


def _put_all(store: SSDStore, blocks) -> None:
    store.put(blocks)
    assert store.flush(10)


def _disk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in (directory / "blocks").rglob("*") if p.is_file())


def _index_hashes(directory: Path) -> list[bytes]:
    with contextlib.closing(sqlite3.connect(directory / "index.sqlite")) as conn:
        return [h for (h,) in conn.execute("SELECT hash FROM blocks")]


# ---- round trip and restart ----


def _drop_page_cache(directory: Path) -> None:
    """Evict the files from the page cache, so that reads take the O_DIRECT path."""
    os.sync()
    for path in directory.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


@pytest.mark.parametrize("cold", [False, True], ids=["page-cache", "cold"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(
    new_store, tmp_path: Path, monkeypatch, dtype: torch.dtype, cold: bool
) -> None:
    store = new_store()
    blocks = [make_block(i, dtype=dtype) for i in range(6)]
    blocks.append(make_block(99, dtype=dtype, shape=(4, 2, 2, 5, 32)))  # partial tail
    _put_all(store, blocks)
    if cold:
        _drop_page_cache(tmp_path / "kv")
    first = block_path(tmp_path / "kv", blocks[0].meta.block_hash)
    with open(first, "rb") as f:  # tmpfs keeps every page: no cold read is possible there
        in_cache = ssd_io._page_cached is None or ssd_io._page_cached(f.fileno(), 4096)
    direct_reads = []
    real_direct = ssd_io._read_direct
    monkeypatch.setattr(
        ssd_io, "_read_direct", lambda *a: direct_reads.append(a) or real_direct(*a)
    )
    got = store.get([b.meta.block_hash for b in blocks] + [block_hash(1000)])
    assert len(direct_reads) == (0 if in_cache else 7)  # O_DIRECT only for what is not cached
    assert got[-1] is None
    assert all(same_block(g, b) for g, b in zip(got, blocks, strict=False))
    assert store.contains([blocks[0].meta.block_hash, block_hash(1000)]) == [True, False]
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.blocks_written) == (7, 1, 7)
    assert stats.bytes_used == _disk_bytes(tmp_path / "kv") == stats.bytes_written
    # The file is plain safetensors: the reference library reads it and agrees.
    tensors = load_file(block_path(tmp_path / "kv", blocks[0].meta.block_hash))
    assert torch.equal(tensors["kv"], blocks[0].kv)
    assert tensors["token_ids"].tolist() == blocks[0].meta.token_ids.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_files_written_by_the_reference_library(tmp_path: Path, dtype) -> None:
    block = make_block(3, dtype=dtype)
    checksum = block_checksum(block)
    meta = {
        "format": "pagedkv.block",
        "version": "1",
        "hash": block.meta.block_hash.hex(),
        "parent_hash": block.meta.parent_key.hex(),
        "namespace": NAMESPACE,
        "num_tokens": str(block.meta.num_tokens),
        "checksum": checksum.hex(),
    }
    path = tmp_path / "ref.safetensors"
    tokens = torch.from_numpy(block.meta.token_ids)
    save_file({"kv": block.kv, "token_ids": tokens}, str(path), metadata=meta)
    got, got_checksum = decode_file(read_file(path), block.meta.block_hash, NAMESPACE)
    assert got_checksum == checksum and same_block(got, block)


def test_restart_finds_blocks_and_children(new_store, tmp_path: Path) -> None:
    store = new_store()
    root = make_block(0)
    tails = [make_block(i, parent=root.meta.block_hash, shape=(4, 2, 2, 3 + i, 32)) for i in (1, 2)]
    _put_all(store, [root, *tails])
    store.close()
    other = new_store(namespace="other-model")
    _put_all(other, [make_block(7, namespace="other-model", parent=root.meta.block_hash)])
    again = new_store()
    children = again.children(root.meta.block_hash)
    assert sorted(c.block_hash for c in children) == sorted(t.meta.block_hash for t in tails)
    by_hash = {t.meta.block_hash: t for t in tails}
    for child in children:
        assert np.array_equal(child.token_ids, by_hash[child.block_hash].meta.token_ids)
    got = again.get([b.meta.block_hash for b in [root, *tails]])
    assert all(same_block(g, b) for g, b in zip(got, [root, *tails], strict=True))
    # Another namespace's block is invisible here, even by its exact hash.
    assert again.get([block_hash(7, "other-model")]) == [None]
    assert again.stats().corrupt == 0


def test_queued_blocks_are_visible_before_they_reach_disk(new_store, monkeypatch) -> None:
    gate = threading.Event()
    _stall_writes(monkeypatch, gate)
    store = new_store()
    block = make_block(1, parent=b"p" * 16)
    store.put([block])
    assert store.contains([block.meta.block_hash]) == [True]
    assert store.get([block.meta.block_hash])[0] is block
    assert [m.block_hash for m in store.children(b"p" * 16)] == [block.meta.block_hash]
    gate.set()
    assert store.flush(10)


# ---- damaged files ----


def _flip_bit(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "bit flip in KV": lambda p: _flip_bit(p, 2000),
    "bit flip in token ids": lambda p: _flip_bit(p, 3),
    "bit flip in header": lambda p: _flip_bit(p, p.stat().st_size - 30),
    "truncated": lambda p: os.truncate(p, p.stat().st_size // 2),
    "garbage": lambda p: p.write_bytes(os.urandom(p.stat().st_size)),
    "deleted": lambda p: p.unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_is_a_miss_and_is_removed(new_store, tmp_path: Path, damage: str) -> None:
    store = new_store()
    blocks = [make_block(i) for i in range(4)]
    _put_all(store, blocks)
    victim = block_path(tmp_path / "kv", blocks[2].meta.block_hash)
    DAMAGE[damage](victim)
    got = store.get([b.meta.block_hash for b in blocks])
    assert got[2] is None
    assert all(same_block(got[i], blocks[i]) for i in (0, 1, 3))
    stats = store.stats()
    assert stats.corrupt == 1 and stats.misses == 1 and stats.num_blocks == 3
    assert stats.extra["missing"] == (damage == "deleted")
    assert not victim.exists()
    assert store.contains([blocks[2].meta.block_hash]) == [False]
    assert store.check().problems == 0


def test_startup_reconciles_files_and_rows(new_store, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = new_store()
    blocks = [make_block(i) for i in range(5)]
    _put_all(store, blocks)
    store.close()
    leaf = block_path(root, blocks[0].meta.block_hash).parent
    stale = leaf / f"{blocks[0].meta.block_hash.hex()}.safetensors.tmp-4194399-abcd"
    stale.write_bytes(b"half a block")
    an_hour_ago = time.time() - 3700  # a pid-named (pre-lock) temporary is stale after an hour
    os.utime(stale, (an_hour_ago, an_hour_ago))
    junk = leaf / "junk.bin"
    junk.write_bytes(b"junk")
    fake = block_path(root, block_hash(555))
    fake.parent.mkdir(parents=True, exist_ok=True)
    fake.write_bytes(os.urandom(5000))  # a well-named file that is not a block
    block_path(root, blocks[1].meta.block_hash).unlink()  # a row without its file
    with contextlib.closing(sqlite3.connect(root / "index.sqlite")) as conn, conn:
        conn.execute("DELETE FROM blocks WHERE hash = ?", (blocks[2].meta.block_hash,))

    report = check_cache(root)
    assert not report.ok
    assert report.temp_files == [str(stale)]
    assert report.rows_without_file == [blocks[1].meta.block_hash.hex()]
    assert sorted(report.files_without_row) == sorted(
        map(str, [junk, fake, block_path(root, blocks[2].meta.block_hash)])
    )

    again = new_store()  # start-up fixes it: the orphan that verifies is re-indexed
    assert again.startup_report is not None and again.startup_report.reindexed == 1
    assert not stale.exists() and not junk.exists() and not fake.exists()
    got = again.get([b.meta.block_hash for b in blocks])
    assert got[1] is None
    assert all(same_block(got[i], blocks[i]) for i in (0, 2, 3, 4))
    assert again.check().problems == 0
    assert again.stats().extra["temp_files_removed"] == 1


def test_check_fix_repairs_corrupt_files(new_store, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = new_store()
    blocks = [make_block(i) for i in range(3)]
    _put_all(store, blocks)
    store.close()
    _flip_bit(block_path(root, blocks[0].meta.block_hash), 100)
    report = check_cache(root)
    assert report.corrupt_files == [str(block_path(root, blocks[0].meta.block_hash))]
    assert not report.ok and not report.fixed
    fixed = check_cache(root, fix=True)
    assert fixed.ok and fixed.fixed and fixed.num_blocks == 2
    assert check_cache(root).problems == 0
    assert cache_stats(root).namespaces[NAMESPACE].num_blocks == 2


# ---- crash ----


def test_kill_9_during_heavy_writes_leaves_a_consistent_cache(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    capacity = 12 * MiB  # small enough that eviction runs while the kill lands
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "write", str(root), str(capacity)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.4)
    finally:
        proc.kill()
        proc.wait(10)
    store = SSDStore(root, capacity, NAMESPACE)
    try:
        report = store.check()
        assert report.ok and report.problems == 0
        hashes = _index_hashes(root)
        assert hashes and report.num_blocks == len(hashes)
        assert all(b is not None for b in store.get(hashes))  # every survivor verifies
        assert _disk_bytes(root) <= capacity
        assert not list(root.rglob("*.tmp-*"))
    finally:
        store.close()


# ---- capacity and LRU ----


def test_lru_order_survives_restart(new_store, tmp_path: Path) -> None:
    a, b = make_block(1), make_block(2)
    capacity = 4 * _file_bytes(a)
    store = new_store(capacity=capacity)
    _put_all(store, [a, b])
    time.sleep(0.01)
    assert store.get([a.meta.block_hash])[0] is not None  # touch A
    store.close()
    again = new_store(capacity=capacity)
    for i in range(3, 6):  # fill past capacity: one block must go
        _put_all(again, [make_block(i)])
    assert again.contains([a.meta.block_hash, b.meta.block_hash]) == [True, False]
    assert again.stats().extra["evictions"] == 1


def test_capacity_is_never_exceeded_across_namespaces(new_store, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    capacity = 1 * MiB
    first = new_store(capacity=capacity, namespace="m1")
    second = new_store(capacity=capacity, namespace="m2")
    for round_ in range(8):
        for store in (first, second):
            store.put([make_block(round_ * 10 + i, namespace=store.namespace) for i in range(6)])
        first.flush(10)
        second.flush(10)
        on_disk = _disk_bytes(root)
        assert on_disk <= capacity
        assert first.stats().bytes_used == on_disk
    usage = first.namespace_usage()
    assert set(usage) == {"m1", "m2"}
    assert sum(u.num_bytes for u in usage.values()) == _disk_bytes(root)
    assert check_cache(root).problems == 0


def test_namespace_quota(new_store, tmp_path: Path) -> None:
    size = _file_bytes(make_block(0))
    limited = new_store(capacity=64 * MiB, namespace="m1", namespace_quota_bytes=3 * size)
    free = new_store(capacity=64 * MiB, namespace="m2")
    _put_all(free, [make_block(i, namespace="m2") for i in range(5)])
    for i in range(6):
        _put_all(limited, [make_block(i, namespace="m1")])
    usage = limited.namespace_usage()
    assert usage["m1"].num_blocks == 3 and usage["m1"].num_bytes <= 3 * size
    assert usage["m2"].num_blocks == 5
    newest = [block_hash(i, "m1") for i in (3, 4, 5)]
    assert limited.contains(newest) == [True, True, True]


# ---- full disk, read-only directory, stalled writer ----


def _ssd_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "writes disabled" in r.getMessage()]


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_injected_write_error_disables_writes_once(
    new_store, monkeypatch, caplog, err: int
) -> None:
    store = new_store()
    stored = [make_block(i) for i in range(3)]
    _put_all(store, stored)
    calls = []

    def fail(*args):
        calls.append(args)
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(ssd_writer, "write_temp", fail)
    with caplog.at_level(logging.WARNING, logger="pagedkv.storage.ssd"):
        for i in range(10, 15):
            store.put([make_block(i)])
            store.flush(5)
    assert len(_ssd_warnings(caplog)) == 1
    assert len(calls) == 1  # nothing is attempted after the first failure
    stats = store.stats()
    assert stats.extra["writes_disabled"] and stats.writes_dropped == 5
    got = store.get([b.meta.block_hash for b in stored])
    assert all(same_block(g, b) for g, b in zip(got, stored, strict=True))


@contextlib.contextmanager
def _mount(args: list[str], target: Path) -> Iterator[None]:
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", *args, str(target)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


def test_real_full_disk_disables_writes_once(new_store, tmp_path: Path, caplog) -> None:
    mnt = tmp_path / "small"
    with _mount(["-t", "tmpfs", "-o", "size=4m", "tmpfs"], mnt):
        store = new_store(mnt / "kv", capacity=1 << 30, put_wait_s=1.0)
        big = (4, 2, 4, 64, 64)  # 512 KiB per block: the 4 MiB disk fills after a few
        blocks = [make_block(i, shape=big) for i in range(12)]
        with caplog.at_level(logging.WARNING, logger="pagedkv.storage.ssd"):
            for block in blocks:
                store.put([block])
                store.flush(10)
        assert len(_ssd_warnings(caplog)) == 1
        stats = store.stats()
        assert stats.extra["writes_disabled"] and stats.writes_dropped >= 1
        assert 0 < stats.blocks_written < 12
        got = store.get([b.meta.block_hash for b in blocks])
        kept = [(g, b) for g, b in zip(got, blocks, strict=True) if g is not None]
        assert len(kept) == stats.blocks_written and all(same_block(g, b) for g, b in kept)
        assert not list((mnt / "kv").rglob("*.tmp-*"))
        store.close()
        assert check_cache(mnt / "kv").problems == 0


def test_read_only_directory_serves_reads(new_store, tmp_path: Path, caplog) -> None:
    src = tmp_path / "kv"
    store = new_store(src)
    blocks = [make_block(i) for i in range(4)]
    _put_all(store, blocks)
    store.close()
    ro = tmp_path / "ro"
    with _mount(["--bind", str(src)], ro):
        done = subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only: {done.stderr.decode().strip()}")
        with caplog.at_level(logging.WARNING, logger="pagedkv.storage.ssd"):
            reader = new_store(ro)
            reader.put([make_block(50)])
            reader.flush(5)
        assert len(_ssd_warnings(caplog)) == 1
        got = reader.get([b.meta.block_hash for b in blocks])
        assert all(same_block(g, b) for g, b in zip(got, blocks, strict=True))
        stats = reader.stats()
        assert stats.extra["writes_disabled"] and stats.writes_dropped == 1
        assert stats.num_blocks == 4
        assert check_cache(ro).problems == 0
        reader.close()
        nowhere = new_store(ro / "not-created")  # cannot even be created: an empty tier
        assert nowhere.writes_disabled and nowhere.get([blocks[0].meta.block_hash]) == [None]


def test_put_does_not_wait_on_a_stalled_writer(new_store, monkeypatch) -> None:
    gate = threading.Event()
    _stall_writes(monkeypatch, gate)
    block_bytes = make_block(0).num_bytes
    store = new_store(write_buffer_bytes=3 * block_bytes, put_wait_s=0.05)
    slowest = 0.0
    for i in range(20):
        start = time.perf_counter()
        store.put([make_block(i)])
        slowest = max(slowest, time.perf_counter() - start)
    assert slowest < 0.05 + 0.5  # the wait budget plus scheduling noise on a busy machine
    dropped = store.stats().writes_dropped
    assert dropped >= 15
    gate.set()
    assert store.flush(10)
    stats = store.stats()
    assert stats.blocks_written + stats.writes_dropped == 20


# ---- two processes ----


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    capacity = 4 * MiB  # about 125 blocks for 200 ids: both processes evict
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "share", str(root), str(capacity), "3", str(first)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for first in (0, 100)
    ]
    live_checks = []  # a check while both write must neither see nor "fix" problems
    while any(p.poll() is None for p in procs) and len(live_checks) < 5:
        if (root / "index.sqlite").exists():
            live_checks.append(check_cache(root).problems)
        time.sleep(0.3)
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    summaries = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [p.returncode for p in procs] == [0, 0], summaries
    for summary in summaries:
        assert summary["wrong"] == 0 and summary["hits"] > 0 and summary["written"] > 0
        assert summary["corrupt"] == 0 and summary["errors"] == 0  # races are not corruption
    assert live_checks and set(live_checks) == {0}
    report = check_cache(root)
    assert report.problems == 0 and report.bytes_used <= capacity


# ---- seed, clear, remove ----


def test_seed_file_is_private_and_stable(new_store, tmp_path: Path, caplog) -> None:
    store = new_store()
    assert store.seed(b"first-seed") == b"first-seed"
    path = tmp_path / "kv" / "seed"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.seed(b"second") == b"first-seed"
    store.close()
    again = new_store()
    assert again.seed(b"third") == b"first-seed"
    assert not again.check_seed(b"first-seed")
    with caplog.at_level(logging.WARNING, logger="pagedkv.storage.ssd"):
        assert again.check_seed(b"configured")
        assert again.check_seed(b"configured")
    assert sum("another hashing seed" in r.getMessage() for r in caplog.records) == 1


def test_concurrent_seed_creation_agrees(tmp_path: Path) -> None:
    from pagedkv.storage.ssd.seed import read_or_create_seed

    results: list[bytes] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(read_or_create_seed(tmp_path, b"%d" % i))
        )
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and (tmp_path / "seed").read_bytes() == results[0]


def test_clear_and_remove(new_store, tmp_path: Path) -> None:
    root = tmp_path / "kv"
    first = new_store(namespace="m1")
    second = new_store(namespace="m2")
    first.seed(b"seed")
    _put_all(first, [make_block(i, namespace="m1") for i in range(4)])
    _put_all(second, [make_block(i, namespace="m2") for i in range(3)])
    first.remove([block_hash(0, "m1")])
    assert first.contains([block_hash(0, "m1")]) == [False]
    assert not block_path(root, block_hash(0, "m1")).exists()
    assert first.clear("m1") == 3
    assert set(first.namespace_usage()) == {"m2"}
    assert clear_cache(root) == 3
    assert cache_stats(root).num_blocks == 0 and _disk_bytes(root) == 0
    assert (root / "seed").read_bytes() == b"seed"


def test_maintenance_refuses_a_directory_that_is_not_a_cache(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a pagedkv SSD cache"):
        check_cache(tmp_path / "nowhere")


def test_flush_waits_for_touches_the_writer_has_taken(new_store, monkeypatch) -> None:
    """A hit's LRU refresh is written by the writer thread; flush returns only after
    it is (a fork after a flush must not catch the writer inside a transaction)."""
    store = new_store()
    block = make_block(1)
    _put_all(store, [block])
    gate, entered = threading.Event(), threading.Event()
    real = store._index.upsert

    def slow_upsert(*args, **kwargs):
        entered.set()
        assert gate.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(store._index, "upsert", slow_upsert)
    assert store.get([block.meta.block_hash])[0] is not None  # queues a touch
    assert entered.wait(10)
    assert not store.flush(0.3)  # the touch is being written
    gate.set()
    assert store.flush(10)


def test_forked_child_gets_its_own_connection_and_writer(new_store, tmp_path: Path) -> None:
    store = new_store()
    old, new = make_block(1), make_block(2)  # built before the fork: the child computes nothing
    _put_all(store, [old])
    store.get([old.meta.block_hash])
    assert store.flush(10)
    pid = os.fork()
    if pid == 0:  # child: threads and SQLite handles of the parent are unusable here
        ok = False
        with contextlib.suppress(BaseException):
            got = store.get([old.meta.block_hash])[0]
            store.put([new])
            ok = got is not None and same_block(got, old) and store.flush(10)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    got = store.get([new.meta.block_hash])[0]  # written by the child, found by the parent
    assert got is not None and same_block(got, new)
