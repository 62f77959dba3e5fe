"""Two block-file format versions on one SSD directory (a rolling upgrade): they coexist.

The other version is this code with `FORMAT_VERSION` patched, which changes
what a file's header says and, through `ssd_versions`, where its files and rows
live: what a release with a new format does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ssd_worker import make_block, same_block

from pagedkv.storage.ssd import format as block_format
from pagedkv.storage.ssd.store import SSDStore, cache_stats
from pagedkv.storage.ssd.versions import block_path

# (this version, the other one): a later release beside us, and us beside the first.
PAIRS = [("1", "3"), ("2", "1")]


def _open(root: Path, monkeypatch: pytest.MonkeyPatch, version: str, **kw) -> SSDStore:
    monkeypatch.setattr(block_format, "FORMAT_VERSION", version)
    kw.setdefault("namespace", "test-model")
    return SSDStore(root, kw.pop("capacity", 64 << 20), **kw)


def _write(store: SSDStore, blocks) -> None:
    store.put(blocks)
    assert store.flush(10)


@pytest.mark.parametrize(("mine", "other"), PAIRS)
def test_another_versions_blocks_survive_open_reads_check_and_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mine: str, other: str
) -> None:
    root = tmp_path / "kv"
    theirs = [make_block(i) for i in range(4)]
    old = _open(root, monkeypatch, other)
    _write(old, theirs)
    old.close()
    their_files = [block_path(root, b.meta.block_hash, other) for b in theirs]
    assert all(p.is_file() for p in their_files)

    store = _open(root, monkeypatch, mine)
    assert store.startup_report is not None and store.startup_report.problems == 0
    hashes = [b.meta.block_hash for b in theirs]
    assert store.get(hashes) == [None] * 4
    report = store.check(fix=True)
    assert all(p.is_file() for p in their_files)  # kept: not taken for corrupt
    assert report.problems == 0 and report.corrupt_files == []
    assert store.contains(hashes) == [False] * 4  # invisible: another version's
    assert store.children(theirs[0].meta.block_hash) == []
    # The same block stored by this version lands beside theirs, not over it.
    ours = [theirs[0], make_block(10)]
    _write(store, ours)
    got = store.get([b.meta.block_hash for b in ours])
    assert all(b is not None and same_block(b, w) for b, w in zip(got, ours, strict=True))
    assert block_path(root, theirs[0].meta.block_hash, mine) != their_files[0]
    stats = store.stats()
    assert stats.extra["other_version_blocks"] == 4
    assert stats.num_blocks == 6  # theirs count toward the directory's capacity
    assert stats.corrupt == 0
    store.close()
    assert all(p.is_file() for p in their_files)
    listed = cache_stats(root)  # `pagedkv cache stats`, run by this version
    assert listed.num_blocks == 2 and list(listed.other_versions) == [other]
    assert listed.other_versions[other].num_blocks == 4

    again = _open(root, monkeypatch, other)  # the other version still has all of its blocks
    assert again.startup_report is not None and again.startup_report.problems == 0
    got = again.get(hashes)
    assert all(b is not None and same_block(b, want) for b, want in zip(got, theirs, strict=True))
    assert again.get([make_block(10).meta.block_hash]) == [None]  # and cannot see ours
    assert again.stats().corrupt == 0
    again.close()


@pytest.mark.parametrize(("mine", "other"), PAIRS)
def test_another_versions_blocks_count_toward_capacity_and_age_out_by_lru(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mine: str, other: str
) -> None:
    """One LRU order across versions: the oldest block goes, whichever version's it is."""
    root = tmp_path / "kv"
    old = _open(root, monkeypatch, other)
    theirs = [make_block(i) for i in range(4)]
    for block in theirs:  # one batch each, so each has a tick of its own
        _write(old, [block])
    size = old.stats().bytes_used // 4
    old.close()
    their_files = [block_path(root, b.meta.block_hash, other) for b in theirs]
    ours = [make_block(i) for i in range(10, 15)]
    store = _open(root, monkeypatch, mine, capacity=6 * size)
    for block in ours[:3]:  # the 7th block's bytes push the oldest out: theirs[0]
        _write(store, [block])
    assert [p.is_file() for p in their_files] == [False, True, True, True]
    assert store.stats().bytes_used <= 6 * size
    store.close()

    old = _open(root, monkeypatch, other, capacity=6 * size)
    assert old.get([theirs[1].meta.block_hash, theirs[3].meta.block_hash]) != [None, None]
    assert old.flush(10)  # their two reads make them the most recently used
    old.close()
    store = _open(root, monkeypatch, mine, capacity=6 * size)
    for block in ours[3:]:  # two more must go: theirs[2], then our oldest
        _write(store, [block])
    assert [p.is_file() for p in their_files] == [False, True, False, True]
    assert store.contains([b.meta.block_hash for b in ours]) == [False, True, True, True, True]
    store.close()

    again = _open(root, monkeypatch, other)  # what is left of theirs is still theirs
    assert again.contains([b.meta.block_hash for b in theirs]) == [False, True, False, True]
    got = again.get([theirs[1].meta.block_hash, theirs[3].meta.block_hash])
    assert all(b is not None and same_block(b, w) for b, w in zip(got, theirs[1::2], strict=True))
    again.close()


def test_a_file_of_another_version_inside_this_versions_tree_is_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only this version's own tree is judged: a foreign file there is deleted."""
    root = tmp_path / "kv"
    old = _open(root, monkeypatch, "3")
    block = make_block(1)
    _write(old, [block])
    old.close()
    theirs = block_path(root, block.meta.block_hash, "3")
    planted = block_path(root, block.meta.block_hash, "1")
    planted.parent.mkdir(parents=True, mode=0o700)
    planted.write_bytes(theirs.read_bytes())
    store = _open(root, monkeypatch, "1")
    assert store.startup_report is not None
    assert store.startup_report.reindexed == 0
    assert not planted.exists() and theirs.is_file()
    store.close()
