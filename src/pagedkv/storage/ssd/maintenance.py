"""Reconciling an SSD cache directory's files with its index: start-up, `check`, `clear`.

Usable without a model or a running store (`pagedkv cache stats|check|clear`):
`cache_stats`, `check_cache` and `clear_cache` take only the directory.
`live_writers` counts the stores that have the directory open now (each holds a
writer lock, `ssd_ownership`), which `pagedkv cache clear` refuses to clear under
unless forced; `namespaces_of_weights` finds a model's namespaces by the
descriptions the stores recorded (`ssd_namespaces`).

Choices:
- A block file without an index row (a crash between rename and insert, or
  an index lost) is re-indexed when it verifies (checksum, hash in its name,
  and, when the store has a cache secret, its MAC), with access tick 0, so it
  ages out first; otherwise it is deleted. Re-indexing keeps KV that cost a
  prefill; it also makes racing with another process's in-flight write
  harmless (it inserts the same row). Without a secret, any self-consistent
  file dropped into `blocks/` is indexed: that is why the directory must be
  private (`ssd_ownership`).
- A temporary file is stale when no live writer holds the lock named in it
  (`ssd_ownership.is_stale_temp`); lock files nobody holds are removed too.
- Only this format version's rows and tree are reconciled: another
  version's files (`ssd_versions`) are neither re-indexed nor deleted here,
  and a file of another version found in this version's tree is corrupt.
- Rows are read before the tree is listed, so a file written meanwhile by
  another process looks unknown (and is re-indexed), never missing.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from os.path import lexists
from pathlib import Path

from pagedkv.errors import CacheCorruptionError
from pagedkv.storage.secret import CacheSecret
from pagedkv.storage.ssd.format import SUFFIX, decode_file
from pagedkv.storage.ssd.index import NamespaceUsage, SSDIndex
from pagedkv.storage.ssd.io import read_file
from pagedkv.storage.ssd.namespaces import NamespaceInfo, read_namespace
from pagedkv.storage.ssd.ownership import (
    LOCK_SUFFIX,
    LOCKS_DIR,
    TEMP_MARK,
    is_stale_temp,
    stale_locks,
)
from pagedkv.storage.ssd.safefile import BadCacheFileError, is_regular_or_missing
from pagedkv.storage.ssd.seed import SEED_NAME
from pagedkv.storage.ssd.versions import block_path, is_version_dir, version_tree

INDEX_NAME = "index.sqlite"
INDEX_SUFFIXES = ("", "-wal", "-shm", "-journal")  # the index and SQLite's files beside it


@dataclass
class CheckReport:
    """What `check` found. Hashes are hex; files are paths. `.ok`: nothing wrong is left."""

    directory: str
    num_blocks: int = 0
    bytes_used: int = 0
    rows_without_file: list[str] = field(default_factory=list)
    files_without_row: list[str] = field(default_factory=list)
    temp_files: list[str] = field(default_factory=list)
    corrupt_files: list[str] = field(default_factory=list)
    reindexed: int = 0
    fixed: bool = False

    @property
    def problems(self) -> int:
        return (
            len(self.rows_without_file)
            + len(self.files_without_row)
            + len(self.temp_files)
            + len(self.corrupt_files)
        )

    @property
    def ok(self) -> bool:
        return self.problems == 0 or self.fixed


@dataclass
class DirectoryStats:
    """Blocks and bytes in a cache directory, in total and per namespace.
    `bytes_per_token`: file bytes (KV, token ids, header) per cached token, by namespace:
    what a token of each model and KV dtype costs on this disk. Counts are this block
    format version's; `other_versions` has other versions' blocks and bytes, by version
    (invisible to this one, but within the same capacity; see `ssd_versions`).
    `descriptions`: who wrote each namespace (`ssd_namespaces`), None where unrecorded.
    `live_writers`: stores that have the directory open now (servers, `generate`)."""

    directory: str
    num_blocks: int
    bytes_used: int
    namespaces: dict[str, NamespaceUsage]
    has_seed: bool
    num_tokens: int = 0
    bytes_per_token: dict[str, float] = field(default_factory=dict)
    other_versions: dict[str, NamespaceUsage] = field(default_factory=dict)
    descriptions: dict[str, NamespaceInfo | None] = field(default_factory=dict)
    live_writers: int = 0


@dataclass(slots=True)
class TreeScan:
    files: dict[bytes, Path] = field(default_factory=dict)
    junk: list[Path] = field(default_factory=list)
    stale_temps: list[Path] = field(default_factory=list)


def _hash_of(name: str, hh1: str, hh2: str) -> bytes | None:
    if not name.endswith(SUFFIX):
        return None
    hexed = name[: -len(SUFFIX)]
    if hexed[:2] != hh1 or hexed[2:4] != hh2:
        return None
    try:
        return bytes.fromhex(hexed)
    except ValueError:
        return None


def scan_tree(root: Path) -> TreeScan:
    """Every file in this format version's tree (`<tree>/<hh>/<hh>/`), sorted into
    blocks, junk and stale temps. Other versions' trees are not looked into."""
    scan = TreeScan()
    top = version_tree(root)
    if not top.is_dir():
        return scan
    for level1 in os.scandir(top):
        if top == root / "blocks" and is_version_dir(level1.name):
            continue  # a later version's tree inside the first version's
        if not level1.is_dir(follow_symlinks=False):
            scan.junk.append(Path(level1.path))
            continue
        for level2 in os.scandir(level1.path):
            if not level2.is_dir(follow_symlinks=False):
                scan.junk.append(Path(level2.path))
                continue
            for entry in os.scandir(level2.path):
                if entry.is_dir(follow_symlinks=False):
                    continue
                if TEMP_MARK in entry.name:
                    if is_stale_temp(root, Path(entry.path)):
                        scan.stale_temps.append(Path(entry.path))
                    continue
                block_hash = _hash_of(entry.name, level1.name, level2.name)
                if block_hash is None:
                    scan.junk.append(Path(entry.path))
                else:
                    scan.files[block_hash] = Path(entry.path)
    return scan


def unlink_quiet(path: Path) -> bool:
    """Remove a file; False when it was already gone or cannot be removed."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def verify_file(
    path: Path,
    block_hash: bytes,
    expected: tuple[int, bytes] | None = None,
    secret: CacheSecret | None = None,
) -> bool:
    """True when the file parses, its checksum (and MAC, with `secret`) holds, and it
    matches `(size, checksum)`."""
    try:
        data = read_file(path, expected[0] if expected else None)
        _, checksum = decode_file(data, block_hash, secret=secret)
    except (OSError, CacheCorruptionError):
        return False
    return expected is None or checksum == expected[1]


def reconcile(
    root: Path, index: SSDIndex, *, fix: bool, verify: bool, secret: CacheSecret | None = None
) -> CheckReport:
    """Compare index rows and files; with `fix`, make them agree.

    `verify` also reads every indexed file and checks it (what `cache check`
    does; start-up skips it, since reads verify each block anyway). Candidates
    found without a lock are confirmed inside a write transaction, where no
    other process can rename or unlink block files, so a live writer elsewhere
    is never reported or "fixed".
    """
    report = CheckReport(directory=str(root))
    rows = index.all_rows()
    scan = scan_tree(root)
    maybe_missing = [h for h in rows if h not in scan.files]
    maybe_unknown = {h: p for h, p in scan.files.items() if h not in rows}
    maybe_corrupt = []
    if verify:
        for h, row in rows.items():
            path = scan.files.get(h)
            if path is not None and not verify_file(path, h, (row.num_bytes, row.checksum), secret):
                maybe_corrupt.append(h)
    with index.transaction():
        now = index.lookup([*maybe_missing, *maybe_unknown, *maybe_corrupt])
        # lexists: a link is an entry of the tree (removed below), not the file it names
        missing = [h for h in maybe_missing if h in now and not lexists(block_path(root, h))]
        unknown = {h: p for h, p in maybe_unknown.items() if h not in now and lexists(p)}
        corrupt = [
            h
            for h in maybe_corrupt
            if h in now
            and not verify_file(block_path(root, h), h, (now[h].num_bytes, now[h].checksum), secret)
        ]
        report.temp_files = [str(p) for p in scan.stale_temps]
        report.rows_without_file = [h.hex() for h in missing]
        report.files_without_row = [str(p) for p in [*unknown.values(), *scan.junk]]
        report.corrupt_files = [str(block_path(root, h)) for h in corrupt]
        if fix and not index.read_only:
            index.delete(missing + corrupt)
            for path in [*map(partial(block_path, root), corrupt), *scan.junk, *scan.stale_temps]:
                unlink_quiet(path)
            report.reindexed = sum(_reindex(index, p, h, secret) for h, p in unknown.items())
            for lock in stale_locks(root):
                unlink_quiet(lock)
            index.rebuild_usage()
            report.fixed = True
    usage = index.usage()
    report.num_blocks = sum(u.num_blocks for u in usage.values())
    report.bytes_used = sum(u.num_bytes for u in usage.values())
    return report


def _reindex(index: SSDIndex, path: Path, block_hash: bytes, secret: CacheSecret | None) -> int:
    """Index a file that verifies (MAC too, with a secret), as least recently used;
    delete one that does not."""
    try:
        data = read_file(path)
        block, checksum = decode_file(data, block_hash, secret=secret)
    except (OSError, CacheCorruptionError):
        unlink_quiet(path)
        return 0
    index.insert_row(block.meta, data.numel(), checksum)
    return 1


def clear_tree(root: Path, index: SSDIndex, namespace: str | None) -> int:
    """Delete every block (of one namespace), rows and files in one transaction.

    Returns the number of indexed blocks removed; without a namespace, stray
    files and stale temporaries go too.
    """
    with index.transaction():
        gone = index.delete_namespace(namespace)
        for h in gone:
            unlink_quiet(block_path(root, h))
        if namespace is None:
            scan = scan_tree(root)
            for p in [*scan.files.values(), *scan.junk, *scan.stale_temps]:
                unlink_quiet(p)
    return len(gone)


def check_index_files(root: Path) -> None:
    """Raise BadCacheFileError when the index or a file SQLite keeps beside it is a
    link or not a regular file: SQLite opens them by name, following links (it would
    open a file elsewhere), and would wait forever reading a FIFO."""
    for suffix in INDEX_SUFFIXES:
        path = root / (INDEX_NAME + suffix)
        if not is_regular_or_missing(path):
            raise BadCacheFileError(path, "is a link or not a regular file")


def open_index(root: Path) -> SSDIndex:
    """The index of an existing cache directory, read-only when the disk is."""
    path = root / INDEX_NAME
    check_index_files(root)
    if not path.is_file():
        raise FileNotFoundError(
            f"{root} is not a pagedkv SSD cache (no {INDEX_NAME}); "
            "pass the directory given as --ssd-cache-dir"
        )
    try:
        return SSDIndex(path)
    except sqlite3.OperationalError:
        return SSDIndex(path, read_only=True)


def _stats(root: Path, index: SSDIndex) -> DirectoryStats:
    usage = index.usage()
    tokens = index.tokens_per_namespace()
    return DirectoryStats(
        directory=str(root),
        num_blocks=sum(u.num_blocks for u in usage.values()),
        bytes_used=sum(u.num_bytes for u in usage.values()),
        namespaces=usage,
        has_seed=(root / SEED_NAME).exists() and is_regular_or_missing(root / SEED_NAME),
        other_versions=index.other_versions_usage(),
        num_tokens=sum(tokens.values()),
        bytes_per_token={
            ns: round(u.num_bytes / tokens[ns], 1) for ns, u in usage.items() if tokens.get(ns)
        },
        descriptions={ns: read_namespace(root, ns) for ns in usage},
        live_writers=live_writers(root),
    )


def cache_stats(directory: str | Path) -> DirectoryStats:
    """Blocks and bytes per namespace in an SSD cache directory."""
    root = Path(directory).expanduser()
    index = open_index(root)
    try:
        return _stats(root, index)
    finally:
        index.close()


def check_cache(directory: str | Path, fix: bool = False) -> CheckReport:
    """Verify every block file against the index (and fix what is wrong with `fix`)."""
    root = Path(directory).expanduser()
    index = open_index(root)
    try:
        return reconcile(root, index, fix=fix, verify=True)
    finally:
        index.close()


def clear_cache(
    directory: str | Path, namespace: str | None = None, namespaces: Sequence[str] = ()
) -> int:
    """Delete all blocks, or those of `namespace` and `namespaces`; the seed file and the
    namespace descriptions stay. Returns blocks removed."""
    root = Path(directory).expanduser()
    chosen = [*([namespace] if namespace is not None else []), *namespaces]
    index = open_index(root)
    try:
        if not chosen:
            return clear_tree(root, index, None)
        return sum(clear_tree(root, index, ns) for ns in dict.fromkeys(chosen))
    finally:
        index.close()


def live_writers(directory: str | Path) -> int:
    """Stores (in any process, or container sharing the volume) that have the directory
    open now: the writer locks someone holds. A lock that cannot be tested counts as held."""
    root = Path(directory).expanduser()
    try:
        names = [e.path for e in os.scandir(root / LOCKS_DIR) if e.name.endswith(LOCK_SUFFIX)]
    except OSError:
        return 0
    free = set(map(str, stale_locks(root)))
    return sum(1 for name in names if name not in free)


def namespaces_of_weights(directory: str | Path, weights: str) -> list[str]:
    """The namespaces with blocks in `directory` whose recorded description names the
    weights digest `weights` (every dtype, KV dtype and block size of one model)."""
    root = Path(directory).expanduser()
    index = open_index(root)
    try:
        usage = index.usage()
    finally:
        index.close()
    found = []
    for ns in usage:
        info = read_namespace(root, ns)
        if info is not None and info.weights == weights:
            found.append(ns)
    return found
