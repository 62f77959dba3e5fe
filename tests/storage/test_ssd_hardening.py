"""SSD tier against a hostile directory and lasting faults: MACs, modes, re-probe, clock, locks."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import stat
import struct
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ssd_worker import make_block, same_block

from pagedkv.errors import CacheCorruptionError
from pagedkv.storage.base import block_checksum
from pagedkv.storage.secret import CacheSecret
from pagedkv.storage.ssd import writer as ssd_writer
from pagedkv.storage.ssd.format import (
    BlockAuthenticationError,
    decode_file,
    encode_file,
    file_size,
    parse_header,
)
from pagedkv.storage.ssd.index import SSDIndex
from pagedkv.storage.ssd.ownership import UnsafeCacheDirectoryError, WriterLock
from pagedkv.storage.ssd.store import SSDStore
from pagedkv.storage.ssd.versions import block_path

SECRET = CacheSecret(b"k" * 32)


def _store(root: Path, **kw) -> SSDStore:
    kw.setdefault("namespace", "test-model")
    return SSDStore(root, kw.pop("capacity", 64 << 20), **kw)


def _file_bytes(block, secret=None) -> bytes:
    prefix, buffers = encode_file(block, block_checksum(block), secret)
    return prefix + b"".join(bytes(b) for b in buffers)


def _forge(block, key: bytes | None = b"attacker" * 4) -> bytes:
    """A self-consistent file for `block` with other KV and a valid unkeyed checksum,
    MACed under a key that is not ours (or with no MAC when `key` is None)."""
    kv = block.kv.clone().fill_(7.0)
    forged = type(block)(block.meta, kv)
    return _file_bytes(forged, CacheSecret(key) if key else None)


def test_forged_file_with_valid_checksum_is_rejected_with_a_secret(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = _store(root, secret=SECRET)
    block = make_block(1)
    store.put([block])
    assert store.flush(10)
    assert same_block(store.get([block.meta.block_hash])[0], block)
    path = block_path(root, block.meta.block_hash)
    forged = _forge(block)
    unmaced = torch.frombuffer(bytearray(_forge(block, None)), dtype=torch.uint8)
    decode_file(unmaced, block.meta.block_hash)  # self-consistent: only the MAC can tell
    with pytest.raises(CacheCorruptionError):
        decode_file(unmaced, block.meta.block_hash, secret=SECRET)
    path.write_bytes(forged)  # same size: the index's size check alone cannot tell
    assert store.get([block.meta.block_hash]) == [None]
    stats = store.stats()
    assert stats.extra["mac_failures"] == 1 and stats.corrupt == 1
    assert not path.exists()
    store.close()


@pytest.mark.parametrize("part", ["kv", "token_ids"])
def test_the_mac_covers_the_kv_bytes_and_the_token_ids(part: str) -> None:
    """One byte changed in the data, header (and so MAC and checksum fields) untouched:
    the MAC, checked before the checksum, must be what rejects it."""
    block = make_block(1)
    raw = bytearray(_file_bytes(block, SECRET))
    header, start = parse_header(memoryview(bytes(raw)))
    entry = header[part]
    assert isinstance(entry, dict)
    raw[start + entry["data_offsets"][0]] ^= 0x01
    data = torch.frombuffer(raw, dtype=torch.uint8)
    with pytest.raises(BlockAuthenticationError):
        decode_file(data, block.meta.block_hash, secret=SECRET)


def test_unindexed_files_are_served_only_if_their_mac_verifies(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    good, bad = make_block(1), make_block(2)
    writer = _store(root, secret=SECRET)
    writer.put([good])
    assert writer.flush(10)
    writer.close()
    (root / "index.sqlite").unlink()  # every file is now unindexed
    path = block_path(root, bad.meta.block_hash)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(_forge(bad))
    again = _store(root, secret=SECRET)
    assert again.startup_report is not None and again.startup_report.reindexed == 1
    got = again.get([good.meta.block_hash, bad.meta.block_hash])
    assert same_block(got[0], good) and got[1] is None
    assert not path.exists()
    again.close()


def test_created_directories_and_files_are_private(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        root = tmp_path / "a" / "kv"
        store = _store(root)
        store.put([make_block(1)])
        assert store.flush(10)
        store.seed(b"s" * 16)
        store.close()
    finally:
        os.umask(old)
    dirs = [root, *[p for p in root.rglob("*") if p.is_dir()]]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {stat.S_IMODE(d.stat().st_mode) for d in dirs} == {0o700}
    assert len(files) >= 3 and {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_directory_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(UnsafeCacheDirectoryError) as err:
        _store(root)
    assert str(root) in str(err.value) and f"chmod 700 {root}" in str(err.value)
    assert not (root / "index.sqlite").exists()


def test_writes_resume_after_enospc_without_a_restart(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ssd_writer, "RETRY_FIRST_S", 0.2)
    store = _store(tmp_path / "kv")
    real = ssd_writer.write_temp
    full = [True]

    def maybe_full(*args):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    monkeypatch.setattr(ssd_writer, "write_temp", maybe_full)
    store.put([make_block(1)])
    store.flush(5)
    assert store.writes_disabled
    full[0] = False  # space again
    deadline = time.monotonic() + 10
    i = 10
    while store.writes_disabled and time.monotonic() < deadline:
        store.put([make_block(i)])
        store.flush(5)
        i += 1
        time.sleep(0.05)
    assert not store.writes_disabled and store.stats().extra["writes_resumed"] == 1
    later = make_block(500)
    store.put([later])
    assert store.flush(5)
    assert same_block(store.get([later.meta.block_hash])[0], later)
    store.close()


def _eviction_order(root: Path, monkeypatch, step_back: bool) -> list[bool]:
    size = file_size(*encode_file(make_block(0), block_checksum(make_block(0))))
    store = _store(root, capacity=3 * size)
    real_time = time.time
    for i in range(3):
        if step_back and i == 1:
            monkeypatch.setattr(time, "time", lambda: real_time() - 86400)
        store.put([make_block(i)])
        assert store.flush(10)
    assert store.get([make_block(0).meta.block_hash])[0] is not None  # touch block 0
    store.flush(10)
    store.put([make_block(3)])  # one must go: block 1, the least recently used
    assert store.flush(10)
    present = store.contains([make_block(i).meta.block_hash for i in range(4)])
    store.close()
    monkeypatch.setattr(time, "time", real_time)
    return present


def test_clock_step_back_does_not_change_eviction_order(tmp_path: Path, monkeypatch) -> None:
    steady = _eviction_order(tmp_path / "a", monkeypatch, step_back=False)
    stepped = _eviction_order(tmp_path / "b", monkeypatch, step_back=True)
    assert steady == [True, False, True, True]
    assert stepped == steady


def test_live_writers_temporaries_are_kept_and_dead_ones_removed(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    _store(root).close()
    leaf = block_path(root, make_block(1).meta.block_hash)
    leaf.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    other = WriterLock(root)  # another container's writer: its pid means nothing here
    live = other.temp_name(leaf)
    live.write_bytes(b"being written")
    store = _store(root)
    assert live.exists() and store.stats().extra["temp_files_removed"] == 0
    store.close()
    other.release()
    dead = WriterLock(root)
    orphan = dead.temp_name(leaf)
    orphan.write_bytes(b"left by a dead writer")
    dead._fd and os.close(dead._fd)  # the writer dies: its lock goes, its lock file stays
    store = _store(root)
    assert live.exists() is False and not orphan.exists()
    assert store.stats().extra["temp_files_removed"] == 2
    store.close()


# ---- total decoder ----


def _valid_file() -> bytes:
    return _file_bytes(make_block(3, shape=(2, 2, 1, 4, 8)), SECRET)


_NUMBERS = [b"1e999", b"-1", b"18446744073709551617", b"0", b"99999999999", b"true", b"[]"]


@st.composite
def _mutated(draw) -> bytes:
    data = bytearray(_valid_file())
    kind = draw(st.sampled_from(["random", "truncate", "flip", "number", "length"]))
    if kind == "random":
        return draw(st.binary(max_size=4096))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if kind == "length":
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + bytes(data[8:])
    (length,) = struct.unpack_from("<Q", data)
    header = bytes(data[8 : 8 + length])
    digits = [i for i, c in enumerate(header) if chr(c).isdigit()]
    i = draw(st.sampled_from(digits))
    j = i
    while j < len(header) and chr(header[j]).isdigit():
        j += 1
    header = header[:i] + draw(st.sampled_from(_NUMBERS)) + header[j:]
    return struct.pack("<Q", len(header)) + header + bytes(data[8 + length :])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated())
def test_any_bytes_decode_to_the_block_or_a_corruption_error(raw: bytes) -> None:
    block = make_block(3, shape=(2, 2, 1, 4, 8))
    data = (
        torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if raw
        else torch.empty(0, dtype=torch.uint8)
    )
    try:
        got, _ = decode_file(data, block.meta.block_hash, "test-model", SECRET)
    except CacheCorruptionError:
        return
    assert same_block(got, block)  # whatever survives the checks is the real block


def test_header_numbers_never_escape_as_other_exceptions() -> None:
    block = make_block(3, shape=(2, 2, 1, 4, 8))
    raw = _valid_file()
    (length,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + length])
    header["kv"]["shape"] = [0, 2**70, 1, 4, 8]
    text = json.dumps(header).encode()
    for bad in (text, text.replace(b"[0, 1180591620717411303424", b"[1e999, 1")):
        data = struct.pack("<Q", len(bad)) + bad + raw[8 + length :]
        with pytest.raises(CacheCorruptionError):
            decode_file(torch.frombuffer(bytearray(data), dtype=torch.uint8), block.meta.block_hash)


def test_opening_a_new_index_waits_while_another_process_holds_it(tmp_path: Path) -> None:
    """Two engines started together on a new directory: one holds the empty new index
    (rollback mode still) while the other switches it to WAL, which SQLite fails at
    once with "database is locked" instead of waiting on busy_timeout."""
    path = tmp_path / "index.sqlite"
    path.touch(mode=0o600)  # as `create_private` leaves it for SQLite
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.3, holder.execute, ("COMMIT",))
    release.start()
    start = time.monotonic()
    index = SSDIndex(path)
    assert time.monotonic() - start >= 0.25  # it waited for the holder, then went on
    assert index.usage() == {}
    assert index.hashes() == []
    release.join()
    index.close()
    holder.close()
