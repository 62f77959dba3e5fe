"""The SSD directory's own files, left there by anyone with write access: the tier starts,
never hangs, never follows a link, never reads an unbounded file, and works.

Every step that could hang on the code before the fix (open(2) of a FIFO) runs on a
thread of its own with a deadline (`within`), so a regression fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from ssd_worker import make_block, same_block

from pagedkv.storage.base import block_checksum
from pagedkv.storage.ssd import io as ssd_io
from pagedkv.storage.ssd.format import encode_file
from pagedkv.storage.ssd.reader import CHOICE_NAME, MIN_SAMPLE_BYTES, ReadPathChooser
from pagedkv.storage.ssd.store import SSDStore
from pagedkv.storage.ssd.versions import block_path

T = TypeVar("T")
DEADLINE_S = 20.0
GOOD_FIGURES = {"version": 1, "path": "buffered", "measured": 6,
                "mib_s": {"direct": [500.0] * 3, "buffered": [2000.0] * 3}}  # fmt: skip


def within(fn: Callable[[], T], seconds: float = DEADLINE_S) -> T:
    """`fn()` on a daemon thread; fails the test if it has not returned in `seconds`."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(("ok", fn()))
        except BaseException as exc:  # handed to the test's thread
            result.append(("raised", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    kind, value = result[0]
    if kind == "raised":
        raise value
    return value  # type: ignore[no-any-return]


@contextlib.contextmanager
def fifo(path: Path) -> Iterator[Path]:
    """A FIFO at `path`; on exit a writer opens and closes it, so that a reader still
    blocked in open(2) (a failing test) gets EOF and its thread ends."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.mkfifo(path, 0o600)
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def _store(root: Path, **kw: Any) -> SSDStore:
    return SSDStore(root, 64 << 20, namespace="test-model", **kw)


def _works(root: Path) -> None:
    """A store on `root` starts in time, writes a block and reads it back."""
    store = within(lambda: _store(root))
    try:
        block = make_block(1)
        store.put([block])
        assert store.flush(10)
        (got,) = within(lambda: store.get([block.meta.block_hash]))
        assert got is not None and same_block(got, block)
    finally:
        store.close()


BAD_FIGURES = {
    "infinite": '{"x": 1e999}',
    "infinite count": json.dumps(GOOD_FIGURES).replace('"measured": 6', '"measured": 1e999'),
    "infinite speeds": '{"mib_s": {"direct": [1e999, 1e999, 1e999], "buffered": [1, 1, 1]}}',
    "NaN": '{"mib_s": {"direct": [NaN, 5, 5], "buffered": [1, 1, 1]}, "measured": NaN}',
    "deep nesting": "[" * 100_000,
    "deep nesting inside": '{"mib_s": ' + "[" * 100_000,
    "booleans for numbers": '{"mib_s": {"direct": [true, true, true], "buffered": [1, 1, 1]}}',
    "a string count": '{"mib_s": {}, "measured": "12"}',
    "a list for the figures": '{"mib_s": [1, 2, 3], "measured": 2}',
    "a huge count": '{"mib_s": {}, "measured": 1' + "0" * 5000 + "}",
    "not UTF-8": b"\xff\xfe{}".decode("latin-1"),
}


@pytest.mark.parametrize("content", list(BAD_FIGURES.values()), ids=list(BAD_FIGURES))
def test_a_malformed_read_path_file_is_ignored_with_a_warning(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    (root / CHOICE_NAME).write_text(content, encoding="latin-1")
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        chooser = within(lambda: ReadPathChooser(root))
    assert chooser.samples() == {"direct": [], "buffered": []}, "measured again from nothing"
    assert any(CHOICE_NAME in r.getMessage() for r in caplog.records if r.levelno >= 30)
    _works(root)


def test_a_huge_read_path_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    with open(root / CHOICE_NAME, "wb") as f:  # sparse: no disk, but 256 MiB to read
        f.truncate(256 << 20)
    reads: list[int] = []
    real_read = os.read

    def counting_read(fd: int, n: int) -> bytes:
        reads.append(n)
        return real_read(fd, n)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "read", counting_read)
        mp.setattr(Path, "read_bytes", lambda p: reads.append(p.stat().st_size) or b"")
        mp.setattr(Path, "read_text", lambda p, *a, **k: reads.append(p.stat().st_size) or "")
        chooser = within(lambda: ReadPathChooser(root))
    assert chooser.samples() == {"direct": [], "buffered": []}
    assert sum(reads) < 1 << 20, f"asked to read {sum(reads)} bytes of a file it cannot use"


def test_a_read_path_file_that_is_a_fifo_is_ignored(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    with fifo(root / CHOICE_NAME):
        chooser = within(lambda: ReadPathChooser(root))
        assert chooser.samples() == {"direct": [], "buffered": []}
        _works(root)


def test_a_read_path_link_is_not_followed_nor_written_through(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(GOOD_FIGURES))
    (root / CHOICE_NAME).symlink_to(elsewhere)
    chooser = within(lambda: ReadPathChooser(root))
    assert chooser.samples() == {"direct": [], "buffered": []}, "the link's target was read"
    chooser.record("direct", MIN_SAMPLE_BYTES, 0.01)
    assert json.loads(elsewhere.read_text()) == GOOD_FIGURES, "written through the link"
    assert not (root / CHOICE_NAME).is_symlink()
    assert json.loads((root / CHOICE_NAME).read_text())["measured"] == 1


def test_files_the_tier_creates_are_created_exclusively_without_following_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file the SSD tier creates (the seed and its temporary, the writer lock, the
    index, block temporaries, the read-path figures' temporary) is opened O_CREAT with
    O_EXCL|O_NOFOLLOW, so a file or link already at that name is never written through.
    A link planted at the read-path temporary's former, predictable name stays untouched."""
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    predictable = f"{CHOICE_NAME}.tmp-{os.getpid()}-{threading.get_ident()}"
    (root / predictable).symlink_to(victim)
    created: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if flags & os.O_CREAT:
            created.append((str(path), flags))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", spy)
    store = _store(root)
    store.seed(b"s" * 16)
    store.put([make_block(1)])
    assert store.flush(10)
    store.reader.chooser.record("direct", MIN_SAMPLE_BYTES, 0.01)
    store.close()
    monkeypatch.undo()
    names = {Path(p).name.partition(".tmp-")[0] for p, _ in created}
    assert {".seed", CHOICE_NAME, "index.sqlite"} <= names and any(
        n.endswith(".safetensors") for n in names
    ), names
    for path, flags in created:
        assert flags & os.O_EXCL and flags & os.O_NOFOLLOW, f"{path} opened without them"
    assert victim.read_text() == "keep me"
    assert json.loads((root / CHOICE_NAME).read_text())["measured"] == 1


def test_a_fifo_at_a_blocks_path_is_a_miss_and_removed(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = _store(root)
    try:
        block = make_block(1)
        store.put([block])
        assert store.flush(10)
        path = block_path(root, block.meta.block_hash)
        path.unlink()
        with fifo(path):
            assert within(lambda: store.get([block.meta.block_hash])) == [None]
            assert not path.exists(), "the FIFO is removed as a corrupt block would be"
        assert store.stats().corrupt == 1
    finally:
        store.close()


def test_a_link_at_a_blocks_path_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    store = _store(root)
    try:
        block = make_block(1)
        store.put([block])
        assert store.flush(10)
        path = block_path(root, block.meta.block_hash)
        outside = tmp_path / "outside.safetensors"
        path.rename(outside)  # the very file: valid, but reached through a link
        path.symlink_to(outside)
        assert within(lambda: store.get([block.meta.block_hash])) == [None]
        assert not path.is_symlink() and outside.exists(), "the link goes, its target stays"
        assert store.stats().corrupt == 1
    finally:
        store.close()


def test_startup_skips_fifos_links_and_huge_files_in_the_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unindexed entries at block names (re-indexed at start-up when they verify) and a
    FIFO among the writer locks: start-up neither hangs, nor follows, nor allocates."""
    root = tmp_path / "kv"
    _works(root)  # a directory with its index and tree
    taken: list[int] = []
    real_take = ssd_io.BLOCK_MEMORY.take

    def take(nbytes: int) -> Any:
        taken.append(nbytes)
        assert nbytes < 64 << 20, f"asked for {nbytes} bytes for one block file"
        return real_take(nbytes)

    monkeypatch.setattr(ssd_io.BLOCK_MEMORY, "take", take)
    huge = block_path(root, make_block(2).meta.block_hash)
    huge.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(huge, "wb") as f:
        f.truncate(5 << 30)  # sparse, over the bound
    linked = make_block(3)
    outside = tmp_path / "outside.safetensors"  # a valid block file, but not in the tree
    prefix, buffers = encode_file(linked, block_checksum(linked))
    outside.write_bytes(prefix + b"".join(bytes(b) for b in buffers))
    link = block_path(root, linked.meta.block_hash)
    link.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    link.symlink_to(outside)
    dangling = block_path(root, make_block(5).meta.block_hash)
    dangling.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    dangling.symlink_to(tmp_path / "nowhere")
    (root / "locks").mkdir(exist_ok=True, mode=0o700)
    with (
        fifo(block_path(root, make_block(4).meta.block_hash)) as pipe,
        fifo(root / "locks" / "w00000000.lock") as lock_pipe,
    ):
        _works(root)
        assert not huge.exists() and not pipe.exists()
        assert not link.is_symlink() and not dangling.is_symlink() and outside.exists()
        store = _store(root)
        assert store.get([linked.meta.block_hash]) == [None], "served through a link"
        store.close()
        assert not lock_pipe.exists(), "a FIFO is no writer's lock"


@pytest.mark.parametrize("name", ["index.sqlite", "index.sqlite-wal", "index.sqlite-shm"])
@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_an_index_that_is_a_fifo_or_a_link_is_not_opened(
    tmp_path: Path, name: str, kind: str
) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    target = tmp_path / "elsewhere.sqlite"
    target.write_bytes(b"")
    with contextlib.ExitStack() as stack:
        if kind == "fifo":
            stack.enter_context(fifo(root / name))
        else:
            (root / name).symlink_to(target)
        store = within(lambda: _store(root))
        try:
            assert store.writes_disabled
            assert within(lambda: store.get([make_block(1).meta.block_hash])) == [None]
        finally:
            store.close()
    assert target.read_bytes() == b"", "SQLite wrote through the link"


@pytest.mark.parametrize("kind", ["fifo", "link", "huge"])
def test_a_seed_file_that_is_not_a_small_regular_file_is_not_used(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    seed = root / "seed"
    with contextlib.ExitStack() as stack:
        if kind == "fifo":
            stack.enter_context(fifo(seed))
        elif kind == "link":
            (tmp_path / "other-seed").write_bytes(b"o" * 16)
            seed.symlink_to(tmp_path / "other-seed")
        else:
            with open(seed, "wb") as f:
                f.truncate(64 << 20)
        store = within(lambda: _store(root))
        try:
            with caplog.at_level(logging.WARNING, logger="pagedkv"):
                got = within(lambda: store.seed(b"c" * 16))
            assert got == b"c" * 16, "the candidate is used, unsaved"
            assert any("seed" in r.getMessage() for r in caplog.records if r.levelno >= 30)
            assert within(lambda: store.check_seed(b"c" * 16)) is False
        finally:
            store.close()
