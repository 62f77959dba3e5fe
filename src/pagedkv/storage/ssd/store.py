"""The persistent SSD tier: one safetensors file per block, an SQLite index, LRU by a logical clock.

Invariants and ordering rules (python-diskcache's `Cache.set` is the model):
- A block becomes visible only once whole: its file is written under a
  temporary name, then renamed into place and its index row inserted in one
  write transaction. Eviction deletes rows and unlinks files in one write
  transaction too, so SQLite's lock orders every rename and unlink across
  processes and a committed row always names an existing file (crashes aside,
  which start-up repairs).
- Reads trust nothing: a file is parsed, its size, hash, namespace and token
  count checked against its header and the index, and its checksum
  recomputed; with a cache secret, its MAC too (a failure is counted in
  `corrupt` and `extra["mac_failures"]`, and handled as corrupt). A failure
  is re-checked under the write lock (another process
  may have evicted the block meanwhile: a plain miss); if it persists, it is
  a miss, the row and file are removed and it is counted (`corrupt`; a
  missing file also as `extra["missing"]`). A read error that may pass (EIO)
  is a miss counted in `errors`, the file kept. Files not in the page cache
  are read with O_DIRECT or buffered, whichever this disk serves faster, as
  measured (see `ssd_reader`), several at once, and `get_each` hands each
  block over as its read completes.
- `put` never waits on the disk (see `ssd_writer`); the caller hands the
  tensors over and must not write into them afterwards (nothing is copied).
- Capacity covers every namespace in the directory (several models, several
  processes); the namespace quota only this store's. Eviction is least
  recently used by the index's logical clock, so the order survives restarts
  and clock steps.
- The directory is private (`ssd_ownership`): created 0700, files 0600, and
  an existing one that others may write is refused at construction.
- A full disk or a read-only directory pauses writes with one warning and
  re-probes with backoff (see `ssd_writer`); reads go on. No fsync by
  default: the rename gives atomicity against a
  crash, and after a power loss the checksum turns a torn file into a miss;
  `fsync=True` buys durability for one sync per block.
- Start-up deletes stale temporaries, re-indexes block files without rows
  that verify, MAC included when a secret is set (deletes the others), drops
  rows without files (see `ssd_maintenance`), then enforces capacity.
- Each block-file format version has files and rows of its own
  (`ssd_versions`): during a rolling upgrade two versions neither see nor
  delete each other's blocks, but share the capacity and one LRU order.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path

from pagedkv.errors import CacheCorruptionError
from pagedkv.storage.base import BlockMeta, KVBlock, KVTier, TierStats
from pagedkv.storage.secret import CacheSecret
from pagedkv.storage.ssd.format import BlockAuthenticationError, decode_file
from pagedkv.storage.ssd.index import IndexRow, NamespaceUsage, SSDIndex
from pagedkv.storage.ssd.io import read_block_file
from pagedkv.storage.ssd.maintenance import (
    INDEX_NAME,
    CheckReport,
    DirectoryStats,
    cache_stats,
    check_cache,
    check_index_files,
    clear_cache,
    clear_tree,
    reconcile,
    unlink_quiet,
)
from pagedkv.storage.ssd.namespaces import NamespaceInfo, described_namespaces, record_namespace
from pagedkv.storage.ssd.ownership import check_directory, make_private_dir
from pagedkv.storage.ssd.reader import BlockReader, ReadBatch, ReadPath, ReadPathChooser
from pagedkv.storage.ssd.safefile import BadCacheFileError
from pagedkv.storage.ssd.seed import read_or_create_seed, read_seed
from pagedkv.storage.ssd.versions import block_path, version_tree
from pagedkv.storage.ssd.writer import BlockWriter, Counters

__all__ = [
    "CheckReport",
    "DirectoryStats",
    "NamespaceUsage",
    "SSDStore",
    "cache_stats",
    "check_cache",
    "clear_cache",
]

log = logging.getLogger(__name__)

MiB = 1024**2


class SSDStore(KVTier):
    """KV blocks in `<directory>/blocks/<hh>/<hh>/<hash>.safetensors`, indexed in SQLite.

    A process may fork after `flush()` returns True: the child starts threads and
    SQLite connections of its own on its first call. A fork while the writer is
    inside a transaction (blocks or LRU touches not yet flushed) leaves the child
    a copy of SQLite's lock state that no thread of it will release."""

    name = "ssd"

    def __init__(
        self,
        directory: str | Path,
        capacity_bytes: int,
        namespace: str,
        *,
        namespace_quota_bytes: int | None = None,
        write_buffer_bytes: int = 256 * MiB,
        read_threads: int = 4,
        put_wait_s: float = 0.05,
        fsync: bool = False,
        secret: CacheSecret | None = None,
        read_path: ReadPath | None = None,
        description: NamespaceInfo | None = None,
    ) -> None:
        if capacity_bytes < 0 or (namespace_quota_bytes is not None and namespace_quota_bytes < 0):
            raise ValueError("SSD capacity and quota must be >= 0 bytes")
        self.directory = Path(directory).expanduser()
        self.secret = secret  # when set, every block file carries a MAC, checked on read
        self.capacity_bytes = int(capacity_bytes)
        self.namespace = namespace
        self.namespace_quota_bytes = namespace_quota_bytes
        self.write_buffer_bytes = int(write_buffer_bytes)
        self.read_threads = max(1, int(read_threads))
        self.put_wait_s = float(put_wait_s)
        self.fsync = fsync
        self.read_path = read_path  # None: measured (`ssd_reader`)
        self.description = description  # recorded for `cache stats` (`ssd_namespaces`)
        self.startup_report: CheckReport | None = None
        self._counters = Counters(self.name, self.capacity_bytes)
        self._seed_warned = False
        self._closed = False
        open_error: BaseException | None = None
        check_directory(self.directory)  # raises UnsafeCacheDirectoryError: no fallback
        try:
            make_private_dir(version_tree(self.directory))
            check_index_files(self.directory)
            self._index = SSDIndex(self.directory / INDEX_NAME)
        except (OSError, sqlite3.Error, BadCacheFileError) as exc:
            open_error = exc
            self._index = self._open_read_only()
        self._start_threads()
        if open_error is not None:
            self._writer.disable(open_error, permanent=True)
        else:
            self._startup()

    def _open_read_only(self) -> SSDIndex:
        try:
            check_index_files(self.directory)
            if (self.directory / INDEX_NAME).is_file():
                return SSDIndex(self.directory / INDEX_NAME, read_only=True)
        except (sqlite3.Error, BadCacheFileError) as exc:
            log.warning("SSD cache index in %s cannot be read (%s)", self.directory, exc)
        return SSDIndex(Path(":memory:"))  # nothing stored and nowhere to write: all misses

    def _start_threads(self) -> None:
        self._pid = os.getpid()
        chooser = ReadPathChooser(self.directory, self.read_path)
        self.reader = BlockReader(self.read_threads, chooser)
        self._writer = BlockWriter(
            self.directory,
            self._index,
            self._counters,
            capacity_bytes=self.capacity_bytes,
            namespace=self.namespace,
            quota_bytes=self.namespace_quota_bytes,
            budget_bytes=self.write_buffer_bytes,
            put_wait_s=self.put_wait_s,
            fsync=self.fsync,
            secret=self.secret,
        )
        self._writer.start()

    def _startup(self) -> None:
        try:
            report = reconcile(
                self.directory, self._index, fix=True, verify=False, secret=self.secret
            )
            self._writer.evict(0)
        except (OSError, sqlite3.Error) as exc:
            self._writer.disable(exc)
            return
        self.startup_report = report
        if self.description is not None:
            record_namespace(self.directory, self.namespace, self.description)
        self._counters.add("reindexed", report.reindexed)
        self._counters.add("temp_files_removed", len(report.temp_files))
        if report.problems:
            log.info(
                "SSD cache %s: removed %d stale temporary files and %d rows without files; "
                "re-indexed %d of %d files without rows",
                self.directory,
                len(report.temp_files),
                len(report.rows_without_file),
                report.reindexed,
                len(report.files_without_row),
            )

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's threads do not exist here
            self._start_threads()

    @property
    def writes_disabled(self) -> bool:
        return self._writer.writes_off is not None

    def flush(self, timeout: float = 10.0) -> bool:
        self._check_pid()
        return self._writer.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued within `timeout` s, drop (and count) the rest, stop threads."""
        if self._closed:
            return
        self._closed = True
        self._writer.close(timeout)
        self.reader.shutdown()
        self._index.close()

    # ---- KVTier ----

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        self._check_pid()
        queued = {h for h in hashes if self._writer.queued(h) is not None}
        try:
            stored = self._index.present([h for h in hashes if h not in queued], self.namespace)
        except sqlite3.Error:
            self._counters.add("errors")
            stored = set()
        return [h in queued or h in stored for h in hashes]

    def get(self, hashes: Sequence[bytes]) -> list[KVBlock | None]:
        return self.get_each(hashes, None)

    def get_each(
        self, hashes: Sequence[bytes], on_block: Callable[[int, KVBlock], object] | None
    ) -> list[KVBlock | None]:
        """`get`, calling `on_block(i, block)` on this thread for every block found,
        each as soon as its read completes (completion order), while the others are
        still being read."""
        self._check_pid()
        out: list[KVBlock | None] = [self._writer.queued(h) for h in hashes]
        if on_block is not None:
            for i, queued in enumerate(out):
                if queued is not None:
                    on_block(i, queued)
        queued_hits = sum(b is not None for b in out)
        try:
            rows = self._index.lookup([h for h, b in zip(hashes, out, strict=True) if b is None])
        except sqlite3.Error:
            self._counters.add("errors")
            rows = {}
        jobs = [
            (i, h, row)
            for i, h in enumerate(hashes)
            if out[i] is None and (row := rows.get(h)) and row.namespace == self.namespace
        ]
        batch = self.reader.begin()
        results: list[tuple[KVBlock | None, str]] = [(None, "error")] * len(jobs)
        # Verified on the read threads (the checksum is a third of a block's CPU time
        # and releases the GIL; measured slower on the caller's thread alone, on 2
        # cores), handed over here as each read lands.
        for k, result in self.reader.completed(lambda job: self._read_one(job, batch), jobs):
            results[k] = result
            if on_block is not None and result[0] is not None:
                on_block(jobs[k][0], result[0])
        self.reader.end(batch)
        suspects = [
            job
            for job, (block, status) in zip(jobs, results, strict=True)
            if block is None and status != "error"
        ]
        if suspects:
            results = self._confirm(jobs, results, suspects)
            retried = {job[0] for job in suspects}
            for (i, _, _), (block, _) in zip(jobs, results, strict=True):
                if on_block is not None and block is not None and i in retried:
                    on_block(i, block)
        hits: list[bytes] = []
        bytes_read = corrupt = missing = errors = forged = 0
        for (i, h, row), (block, status) in zip(jobs, results, strict=True):
            if block is not None:
                out[i] = block
                hits.append(h)
                bytes_read += row.num_bytes
            errors += status == "error"
            corrupt += status in ("missing", "corrupt", "forged")
            missing += status == "missing"
            forged += status == "forged"
        if hits:
            self._writer.touch(hits)
        with self._counters.lock:
            s = self._counters.stats
            s.hits += len(hits) + queued_hits
            s.misses += len(hashes) - len(hits) - queued_hits
            s.bytes_read += bytes_read
            s.corrupt += corrupt
            s.errors += errors
            self._counters.extra["missing"] += missing
            self._counters.extra["mac_failures"] += forged
        return out

    def _confirm(
        self,
        jobs: list[tuple[int, bytes, IndexRow]],
        results: list[tuple[KVBlock | None, str]],
        suspects: list[tuple[int, bytes, IndexRow]],
    ) -> list[tuple[KVBlock | None, str]]:
        """Re-read failed blocks under the write lock before calling them bad.

        Outside the lock another process may have evicted a block (its row and
        file gone: a plain miss, "gone") or replaced its file between our index
        lookup and our read. Under the lock no file can change, so a second
        failure is real: its row and file are removed in the same transaction.
        """
        confirmed = dict(zip([job[1] for job in jobs], results, strict=True))
        try:
            with self._index.transaction():
                rows = self._index.lookup([h for _, h, _ in suspects])
                bad = []
                for i, h, _ in suspects:
                    row = rows.get(h)
                    if row is None:
                        confirmed[h] = (None, "gone")
                        continue
                    confirmed[h] = self._read_one((i, h, row))
                    if confirmed[h][1] in ("missing", "corrupt", "forged"):
                        bad.append(h)
                self._index.delete(bad)
                for h in bad:
                    unlink_quiet(block_path(self.directory, h))
        except sqlite3.Error:
            return [(None, "error") if b is None else (b, st) for b, st in results]
        return [confirmed[job[1]] for job in jobs]

    def _read_one(
        self, job: tuple[int, bytes, IndexRow], batch: ReadBatch | None = None
    ) -> tuple[KVBlock | None, str]:
        _, block_hash, row = job
        try:
            read = read_block_file(
                block_path(self.directory, block_hash), row.num_bytes, batch is None or batch.direct
            )
            if batch is not None:
                batch.count(row.num_bytes, read.cold)
            # The one place a read block is verified, for get, get_each and _confirm
            # alike, MAC included when a secret is set.
            block, checksum = decode_file(read.data, block_hash, self.namespace, self.secret)
        except FileNotFoundError:
            return None, "missing"
        except BlockAuthenticationError:
            return None, "forged"
        except CacheCorruptionError:
            return None, "corrupt"
        except OSError:
            return None, "error"
        if checksum != row.checksum:
            return None, "corrupt"
        return block, "ok"

    def _discard(self, hashes: list[bytes]) -> None:
        """Drop the rows and files of blocks that failed verification (or were removed)."""
        try:
            with self._index.transaction():
                self._index.delete(hashes)
                for h in hashes:
                    unlink_quiet(block_path(self.directory, h))
        except sqlite3.Error:
            self._counters.add("errors")

    def put(self, blocks: Sequence[KVBlock]) -> None:
        self._check_pid()
        for block in blocks:
            kv, meta = block.kv, block.meta
            if meta.namespace != self.namespace:
                raise ValueError(
                    f"block namespace {meta.namespace!r} is not this store's {self.namespace!r}"
                )
            if kv.dim() != 5 or kv.shape[3] != meta.num_tokens:
                raise ValueError(
                    f"block KV must be [layers, 2, kv_heads, {meta.num_tokens}, head_dim], "
                    f"got {list(kv.shape)}"
                )
        self._writer.submit(blocks)

    def set_max_leased_fraction(self, fraction: float) -> None:
        self._writer.leased.max_fraction = fraction

    def lease(self, hashes: Sequence[bytes], ttl_s: float) -> None:
        """Evicted last (`SSDIndex.evict`), within the fraction of `capacity_bytes`;
        held in this process's memory only: another process sharing the directory, or
        this one after a restart, evicts them in LRU order."""
        self._writer.leased.add(hashes)

    def release_lease(self, hashes: Sequence[bytes]) -> None:
        self._writer.leased.release(hashes)

    def remove(self, hashes: Sequence[bytes]) -> None:
        self._check_pid()
        self._writer.cancel(hashes)
        self._discard(list(hashes))

    def other_namespaces(self) -> dict[str, NamespaceInfo | None]:
        """The directory's other described namespaces (explain's `identity_changed`)."""
        found = described_namespaces(self.directory)
        found.pop(self.namespace, None)
        return found

    def contains_in(self, namespace: str, hashes: Sequence[bytes]) -> list[bool]:
        """`contains` for another namespace's blocks in this directory (index only)."""
        self._check_pid()
        try:
            stored = self._index.present(list(hashes), namespace)
        except sqlite3.Error:
            self._counters.add("errors")
            stored = set()
        return [h in stored for h in hashes]

    def children(self, parent_key: bytes) -> list[BlockMeta]:
        self._check_pid()
        try:
            found = self._index.children(parent_key, self.namespace)
        except sqlite3.Error:
            self._counters.add("errors")
            found = []
        seen = {m.block_hash for m in found}
        for meta in self._writer.queued_children(parent_key):
            if meta.block_hash not in seen:
                seen.add(meta.block_hash)
                found.append(BlockMeta(meta.block_hash, parent_key, meta.token_ids, meta.namespace))
        return found

    def stats(self) -> TierStats:
        """This store's counters. `num_blocks` and `bytes_used` cover the whole directory,
        other format versions' blocks included (what `capacity_bytes` bounds); `extra`
        has this namespace's share and other versions' blocks (`other_version_blocks`)."""
        try:
            usage = self._index.usage()
            others = self._index.other_versions_usage()
        except sqlite3.Error:
            usage, others = {}, {}
        mine = usage.get(self.namespace, NamespaceUsage(0, 0))
        directory = [*usage.values(), *others.values()]
        queued_blocks, queued_bytes = self._writer.queue_size()
        with self._counters.lock:
            s = self._counters.stats
            result = TierStats(
                self.name, s.hits, s.misses, s.bytes_read, s.bytes_written, s.blocks_written,
                s.writes_dropped, s.corrupt, s.errors,
                num_blocks=sum(u.num_blocks for u in directory),
                bytes_used=sum(u.num_bytes for u in directory),
                capacity_bytes=self.capacity_bytes,
                location=str(self.directory),
            )  # fmt: skip
            result.extra = {**self._counters.extra}
        result.extra.update(
            namespace_blocks=mine.num_blocks,
            namespace_bytes=mine.num_bytes,
            namespaces=len(usage),
            other_version_blocks=sum(u.num_blocks for u in others.values()),
            queued_blocks=queued_blocks,
            queued_bytes=queued_bytes,
            writes_disabled=self.writes_disabled,
        )
        if self.namespace_quota_bytes is not None:
            result.extra["namespace_quota_bytes"] = self.namespace_quota_bytes
        return result

    # ---- maintenance ----

    def namespace_usage(self) -> dict[str, NamespaceUsage]:
        """Blocks and bytes of every namespace in the directory."""
        return self._index.usage()

    def directory_stats(self) -> DirectoryStats:
        return cache_stats(self.directory)

    def check(self, fix: bool = False) -> CheckReport:
        """Verify every file against the index; with `fix`, reconcile and enforce capacity."""
        self.flush()
        fix = fix and not self.writes_disabled
        report = reconcile(self.directory, self._index, fix=fix, verify=True, secret=self.secret)
        if report.fixed:
            self._writer.evict(0)
        return report

    def clear(self, namespace: str) -> int:
        """Delete every block of `namespace` (other namespaces and the seed file stay).
        Returns the number of blocks removed. `pagedkv cache clear` without a namespace
        is the way to empty a whole directory."""
        self._writer.cancel(namespace=namespace)
        self._writer.flush(10.0)
        return clear_tree(self.directory, self._index, namespace)

    def seed(self, candidate: bytes) -> bytes:
        """The directory's hashing seed: the seed file's bytes, created from `candidate`
        (mode 0600) when absent. A directory that cannot be written yields `candidate`."""
        return read_or_create_seed(self.directory, candidate)

    def check_seed(self, seed: bytes) -> bool:
        """True (and one warning per store) when the seed file holds another seed."""
        try:
            stored = read_seed(self.directory)
        except BadCacheFileError as exc:
            if not self._seed_warned:
                self._seed_warned = True
                log.warning("%s; the seed in use is not kept", exc)
            return False
        if stored is None or stored == seed:
            return False
        if not self._seed_warned:
            self._seed_warned = True
            log.warning(
                "SSD cache %s holds blocks made under another hashing seed than the one in "
                "use: they cannot be found and will age out by LRU. Leave hash_seed unset to "
                "adopt the directory's seed file.",
                self.directory,
            )
        return True
