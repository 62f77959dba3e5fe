"""The SSD read path: the measured choice of read path, blocks handed over as their
reads complete, reads that leave the page cache as they found it, reused memory."""

from __future__ import annotations

import gc
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from ssd_worker import NAMESPACE, block_hash, make_block, same_block

from pagedkv.storage.ssd import io as ssd_io
from pagedkv.storage.ssd import reader as ssd_reader
from pagedkv.storage.ssd.memory import HUGE, BlockMemory
from pagedkv.storage.ssd.reader import (
    CHOICE_NAME,
    MIN_SAMPLE_BYTES,
    MIN_SAMPLES,
    RETRY_EVERY,
    BlockReader,
    ReadPathChooser,
)
from pagedkv.storage.ssd.store import SSDStore
from pagedkv.storage.ssd.versions import block_path

MiB = 1024**2
BIG = MIN_SAMPLE_BYTES  # one measurable batch


def _measure(chooser: ReadPathChooser, mib_s: dict[str, float], batches: int) -> list[str]:
    """Run `batches` batches, each taking the path the chooser picks at that speed."""
    picked = []
    for _ in range(batches):
        path = chooser.pick()
        picked.append(path)
        chooser.record(path, BIG, BIG / MiB / mib_s[path])
    return picked


def test_chooser_tries_both_then_keeps_the_faster_and_retries_the_other(tmp_path: Path) -> None:
    chooser = ReadPathChooser(tmp_path)
    picked = _measure(chooser, {"direct": 500.0, "buffered": 2000.0}, 2 * MIN_SAMPLES)
    assert sorted(picked) == sorted(["direct", "buffered"] * MIN_SAMPLES)
    assert chooser.path == "buffered"
    later = _measure(chooser, {"direct": 500.0, "buffered": 2000.0}, 2 * RETRY_EVERY)
    assert later.count("direct") == 2, "the slower path is retried once every RETRY_EVERY"
    # The disk changes: the retries notice, and the choice follows.
    _measure(chooser, {"direct": 3000.0, "buffered": 1000.0}, 4 * RETRY_EVERY)
    assert chooser.path == "direct"


def test_chooser_keeps_its_figures_in_the_directory_across_restarts(tmp_path: Path) -> None:
    first = ReadPathChooser(tmp_path)
    _measure(first, {"direct": 800.0, "buffered": 1900.0}, 2 * MIN_SAMPLES)
    state = json.loads((tmp_path / CHOICE_NAME).read_text())
    assert state["path"] == "buffered"
    assert (tmp_path / CHOICE_NAME).stat().st_mode & 0o777 == 0o600
    again = ReadPathChooser(tmp_path)
    assert again.path == "buffered"
    assert again.pick() == "buffered", "a restart does not measure from scratch"


def test_chooser_retries_the_other_path_across_restarts(tmp_path: Path) -> None:
    """A server restarted after every restore still retries the slower path on
    schedule (the count of measured restores survives in the file)."""
    speeds = {"direct": 500.0, "buffered": 2000.0}
    _measure(ReadPathChooser(tmp_path), speeds, 2 * MIN_SAMPLES)
    picked = [_measure(ReadPathChooser(tmp_path), speeds, 1)[0] for _ in range(2 * RETRY_EVERY)]
    assert picked.count("direct") == 2
    assert picked.count("buffered") == 2 * RETRY_EVERY - 2


def test_chooser_ignores_small_or_warm_batches_and_a_broken_file(tmp_path: Path) -> None:
    (tmp_path / CHOICE_NAME).write_text("{not json")
    chooser = ReadPathChooser(tmp_path)
    chooser.record("buffered", BIG - 1, 0.001)  # too small to say anything
    assert chooser.samples() == {"direct": [], "buffered": []}
    pinned = ReadPathChooser(tmp_path / "other", fixed="buffered")
    assert _measure(pinned, {"direct": 1.0, "buffered": 1.0}, 5) == ["buffered"] * 5
    assert not (tmp_path / "other" / CHOICE_NAME).exists()


def test_reader_hands_results_over_as_they_complete() -> None:
    reader = BlockReader(4, ReadPathChooser(None))
    second_seen = threading.Event()
    order: list[int] = []

    def job(k: int) -> int:
        if k == 0:  # finishes only once the caller has the result of job 1
            assert second_seen.wait(10), "results were held back until all jobs finished"
        return k * 10

    for k, result in reader.completed(job, [0, 1]):
        order.append(k)
        assert result == k * 10
        if k == 1:
            second_seen.set()
    assert order == [1, 0]
    reader.shutdown()


def test_reader_raises_a_jobs_error_after_the_others_finish() -> None:
    reader = BlockReader(2, ReadPathChooser(None))
    finished: list[int] = []

    def job(k: int) -> int:
        if k == 1:
            raise OSError("disk on fire")
        finished.append(k)
        return k

    with pytest.raises(OSError, match="disk on fire"):
        list(reader.completed(job, [0, 1, 2]))
    assert sorted(finished) == [0, 2]
    reader.shutdown()


@pytest.fixture
def store(tmp_path: Path):
    made: list[SSDStore] = []

    def make(**kwargs: object) -> SSDStore:
        s = SSDStore(tmp_path / "kv", 64 * MiB, NAMESPACE, **kwargs)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield make
    for s in made:
        s.close(timeout=2)


def test_get_each_hands_each_block_over_while_the_others_are_read(store, monkeypatch) -> None:
    ssd = store(read_threads=4)
    blocks = [make_block(i) for i in range(3)]
    ssd.put(blocks)
    assert ssd.flush(10)
    gate = threading.Event()
    real = ssd_io.read_block_file
    first = block_path(ssd.directory, blocks[0].meta.block_hash)

    def slow_first(path: Path, *args: object) -> ssd_io.FileRead:
        if path == first:
            assert gate.wait(10), "no block was handed over before the last read ended"
        return real(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr("pagedkv.storage.ssd.store.read_block_file", slow_first)
    seen: list[int] = []

    def on_block(i: int, block: object) -> None:
        seen.append(i)
        if len(seen) == 2:
            gate.set()

    got = ssd.get_each([b.meta.block_hash for b in blocks] + [block_hash(99)], on_block)
    assert seen[-1] == 0 and sorted(seen) == [0, 1, 2]
    assert got[3] is None
    assert all(same_block(g, b) for g, b in zip(got, blocks, strict=False))


def _drop(path: Path) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached(path: Path) -> bool:
    assert ssd_io._page_cached is not None
    fd = os.open(path, os.O_RDONLY)
    try:
        return ssd_io._page_cached(fd, path.stat().st_size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_cold_reads_leave_nothing_in_the_page_cache(tmp_path: Path, direct: bool) -> None:
    if ssd_io._page_cached is None:
        pytest.skip("no mincore here")
    path = tmp_path / "f.bin"
    data = os.urandom(3 * MiB + 123)
    path.write_bytes(data)
    _drop(path)
    if _cached(path):
        pytest.skip("this filesystem keeps every page (tmpfs): no cold read exists")
    read = ssd_io.read_block_file(path, len(data), direct=direct)
    assert read.cold
    assert bytes(read.data.numpy()) == data
    assert not _cached(path), "a cold read left the file in the page cache"
    warm = tmp_path / "w.bin"
    warm.write_bytes(data)  # just written: in the page cache, and left there
    again = ssd_io.read_block_file(warm, len(data), direct=direct)
    assert not again.cold and bytes(again.data.numpy()) == data
    assert _cached(warm)


def test_store_records_its_cold_restores_on_the_path_it_took(store, monkeypatch) -> None:
    monkeypatch.setattr(ssd_reader, "MIN_SAMPLE_BYTES", 1)
    ssd = store(read_threads=2)
    blocks = [make_block(i) for i in range(4)]
    ssd.put(blocks)
    assert ssd.flush(10)
    hashes = [b.meta.block_hash for b in blocks]
    files = [block_path(ssd.directory, h) for h in hashes]
    for f in files:
        _drop(f)
    if _cached(files[0]):
        pytest.skip("this filesystem keeps every page (tmpfs): no cold read exists")
    assert all(b is not None for b in ssd.get(hashes))
    samples = ssd.reader.chooser.samples()
    assert sum(len(v) for v in samples.values()) == 1
    assert all(b is not None for b in ssd.get(hashes))  # still cold: the reads dropped it
    assert sum(len(v) for v in ssd.reader.chooser.samples().values()) == 2
    for f in files:
        f.read_bytes()  # in the page cache now
    samples = ssd.reader.chooser.samples()
    assert all(b is not None for b in ssd.get(hashes))  # warm: not a measurement
    assert ssd.reader.chooser.samples() == samples


def test_block_memory_reuses_a_buffer_only_once_all_its_views_are_gone() -> None:
    pool = BlockMemory(keep_bytes=8 * MiB)
    size = 3 * MiB
    first = pool.take(size)
    assert first.data_ptr() % HUGE == 0
    first.fill_(7)
    view = first[100:200]
    del first
    gc.collect()
    second = pool.take(size)
    second.fill_(1)
    assert int(view.sum()) == 7 * 100, "a buffer was reused while a view of it lived"
    del view, second
    gc.collect()
    assert pool.kept_bytes == 2 * size
    pool.take(size)
    assert pool.num_created == 2 and pool.num_taken == 3


def test_block_memory_keeps_no_more_than_its_limit() -> None:
    pool = BlockMemory(keep_bytes=5 * MiB)
    taken = [pool.take(2 * MiB) for _ in range(4)]
    del taken
    gc.collect()
    assert pool.kept_bytes == 4 * MiB
    assert torch.empty(0).numel() == 0  # the pool works beside torch's own allocator
