"""The SSD store's background writer: a bounded queue, one thread, LRU eviction.

Invariants:
- `put` never waits on the disk: blocks queue within `budget_bytes`; a call
  whose blocks do not fit waits at most `put_wait_s` in total, then drops the
  rest (counted in `writes_dropped`). A block larger than the whole budget is
  still taken when the queue is empty, so one huge block cannot starve.
- A queued block stays visible (`queued`, `queued_children`) until its row is
  committed, so a lookup right after `put` finds it.
- Per batch: make room (evict LRU rows and their files) for the bytes about
  to land; write each file under a temporary name (no lock held); then, in
  one write transaction, rename them into place and insert their rows; then
  evict once more for what other processes added meanwhile. Renames and
  unlinks happen only inside write transactions (see `ssd_index`).
- Access times (`touch`) are applied by this thread, in the batch's
  transaction, so readers never wait for SQLite's write lock.
- A space or permission error pauses writes, with one warning: queued blocks
  are dropped, and `put` drops (and counts) blocks until the pause ends. Then
  the next batch is the probe: if it lands, writes resume (logged); if it
  fails again, the pause doubles, from `RETRY_FIRST_S` up to `RETRY_MAX_S`. The
  rejected alternative, off until restart, kept a moment of ENOSPC costing the
  SSD tier for the rest of the process. Only a directory that could not be
  opened at all stays off (`disable(..., permanent=True)`).
- Temporaries are named for this writer and covered by its `WriterLock`
  (see `ssd_ownership`), so no other process takes them for stale.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pagedkv.storage.base import BlockMeta, KVBlock, TierStats, block_checksum
from pagedkv.storage.leased import LeasedHashes
from pagedkv.storage.secret import CacheSecret
from pagedkv.storage.ssd.format import encode_file, file_size
from pagedkv.storage.ssd.index import SSDIndex
from pagedkv.storage.ssd.maintenance import unlink_quiet
from pagedkv.storage.ssd.ownership import WriterLock, make_private_dir, write_temp
from pagedkv.storage.ssd.safefile import MAX_BLOCK_FILE_BYTES
from pagedkv.storage.ssd.versions import block_path

log = logging.getLogger("pagedkv.storage.ssd")

MiB = 1024**2
_BATCH_BLOCKS = 64
_BATCH_BYTES = 64 * MiB
_DISABLING_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 60.0


class Counters:
    """A tier's counters behind one lock: `TierStats` fields plus named extras."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        self.lock = threading.Lock()
        self.stats = TierStats(name, capacity_bytes=capacity_bytes)
        self.extra = {
            "missing": 0,
            "evictions": 0,
            "reindexed": 0,
            "temp_files_removed": 0,
            "mac_failures": 0,
            "writes_resumed": 0,
        }

    def add(self, name: str, n: int = 1) -> None:
        if not n:
            return
        with self.lock:
            if name in self.extra:
                self.extra[name] += n
            else:
                setattr(self.stats, name, getattr(self.stats, name) + n)


class _BatchFailed(Exception):
    """Ends a batch whose failure has been accounted for."""


def is_disabling(exc: BaseException) -> bool:
    """A full disk, a quota, or a directory we may not write: retrying will not help."""
    if isinstance(exc, OSError):
        return exc.errno in _DISABLING_ERRNOS
    text = str(exc).lower()
    return isinstance(exc, sqlite3.Error) and ("full" in text or "readonly" in text)


class BlockWriter:
    """Queues blocks and writes them from one daemon thread; see the module docstring."""

    def __init__(
        self,
        directory: Path,
        index: SSDIndex,
        counters: Counters,
        *,
        capacity_bytes: int,
        namespace: str,
        quota_bytes: int | None,
        budget_bytes: int,
        put_wait_s: float,
        fsync: bool,
        secret: CacheSecret | None = None,
    ) -> None:
        self.directory = directory
        self.index = index
        self.counters = counters
        self.capacity_bytes = capacity_bytes
        self.leased = LeasedHashes()  # the store's leases, evicted last
        self.namespace = namespace
        self.quota_bytes = quota_bytes
        self.budget_bytes = budget_bytes
        self.put_wait_s = put_wait_s
        self.fsync = fsync
        self.secret = secret
        self.writes_off: str | None = None
        self._retry_at: float | None = None  # monotonic; None: off for good (or on)
        self._retry_s = RETRY_FIRST_S
        self._lock: WriterLock | None = None
        self._cond = threading.Condition()
        self._pending: dict[bytes, KVBlock] = {}  # queued, oldest first
        self._inflight: dict[bytes, KVBlock] = {}  # taken by the thread, not yet indexed
        self._queued_bytes = 0
        self._touches: set[bytes] = set()
        self._touching = False  # a batch of touches taken off `_touches`, not yet written
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-ssd-writer", daemon=True)

    def start(self) -> None:
        self._lock = WriterLock(self.directory)
        self._thread.start()

    def _paused(self) -> bool:
        """Writes are off and not due for a probe; the caller holds `_cond`."""
        if self.writes_off is None:
            return False
        return self._retry_at is None or time.monotonic() < self._retry_at

    # ---- called by request threads ----

    def submit(self, blocks: Sequence[KVBlock]) -> None:
        dropped = 0
        deadline: float | None = None
        with self._cond:
            for block in blocks:
                h, size = block.meta.block_hash, block.num_bytes
                if h in self._pending or h in self._inflight:
                    continue
                while self._over_budget(size) and not self._stop and not self._paused():
                    if deadline is None:
                        deadline = time.monotonic() + self.put_wait_s
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                if self._over_budget(size) or self._stop or self._paused():
                    dropped += 1
                    continue
                self._pending[h] = block
                self._queued_bytes += size
            self._cond.notify_all()
        self.counters.add("writes_dropped", dropped)

    def _over_budget(self, size: int) -> bool:
        return self._queued_bytes > 0 and self._queued_bytes + size > self.budget_bytes

    def queued(self, block_hash: bytes) -> KVBlock | None:
        with self._cond:
            return self._pending.get(block_hash) or self._inflight.get(block_hash)

    def queued_children(self, parent_key: bytes) -> list[BlockMeta]:
        with self._cond:
            blocks = [*self._inflight.values(), *self._pending.values()]
        return [b.meta for b in blocks if b.meta.parent_key == parent_key]

    def touch(self, hashes: Sequence[bytes]) -> None:
        with self._cond:
            self._touches.update(hashes)
            self._cond.notify_all()

    def cancel(self, hashes: Sequence[bytes] | None = None, namespace: str | None = None) -> None:
        """Forget queued blocks: these hashes, or every one of `namespace` (None: all)."""
        with self._cond:
            if hashes is None:
                hashes = [
                    h
                    for h, b in self._pending.items()
                    if namespace is None or b.meta.namespace == namespace
                ]
            for h in hashes:
                block = self._pending.pop(h, None)
                if block is not None:
                    self._queued_bytes -= block.num_bytes
            self._cond.notify_all()

    def queue_size(self) -> tuple[int, int]:
        with self._cond:
            return len(self._pending) + len(self._inflight), self._queued_bytes

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (
                self._pending
                or self._inflight
                or self._touching
                or (self._touches and not self._paused())
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout: float) -> None:
        """Flush within `timeout`, drop (and count) what is left, stop the thread."""
        start = time.monotonic()
        self.flush(timeout)
        with self._cond:
            self._stop = True
            self._drop_pending()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(max(0.1, timeout - (time.monotonic() - start)))
        if self._lock is not None and not self._thread.is_alive():
            self._lock.release()

    def _drop_pending(self) -> None:
        """Drop every queued block; the caller holds `_cond`."""
        self.counters.add("writes_dropped", len(self._pending))
        self._queued_bytes -= sum(b.num_bytes for b in self._pending.values())
        self._pending.clear()

    # ---- the thread ----

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._touches or self._stop):
                    self._cond.wait()
                if self._stop:
                    return
                batch: list[KVBlock] = []
                size = 0
                for h in list(self._pending)[:_BATCH_BLOCKS]:
                    if batch and size >= _BATCH_BYTES:
                        break
                    block = self._pending.pop(h)
                    self._inflight[h] = block
                    batch.append(block)
                    size += block.num_bytes
                touches, self._touches = self._touches, set()
                self._touching = bool(touches)
            try:
                with self._cond:
                    paused = self._paused()
                if paused:
                    self.counters.add("writes_dropped", len(batch))
                else:
                    self._write_batch(batch, touches)
                    if batch:  # blocks reached the disk: the probe passed
                        self._resume()
            except _BatchFailed:
                pass
            except Exception:
                log.exception("SSD cache writer failed on a batch of %d blocks", len(batch))
                self.counters.add("errors")
                self.counters.add("writes_dropped", len(batch))
            finally:
                with self._cond:
                    for block in batch:
                        self._inflight.pop(block.meta.block_hash, None)
                        self._queued_bytes -= block.num_bytes
                    self._touching = False
                    self._cond.notify_all()

    def _write_batch(self, batch: list[KVBlock], touches: set[bytes]) -> None:
        try:
            existing = self.index.present([b.meta.block_hash for b in batch], None)
        except sqlite3.Error as exc:
            self._fail(exc, len(batch))
        touches |= existing  # already stored (maybe by another process): only refresh it
        todo = []
        for block in batch:
            if block.meta.block_hash in existing:
                continue
            checksum = block_checksum(block)
            prefix, buffers = encode_file(block, checksum, self.secret)
            size = file_size(prefix, buffers)
            too_big = size > MAX_BLOCK_FILE_BYTES  # readers would take it for junk
            if too_big or size > self.capacity_bytes or size > (self.quota_bytes or size):
                self.counters.add("writes_dropped")
                continue
            todo.append((block.meta, checksum, prefix, buffers, size))
        temps: list[tuple[Path, BlockMeta, int, bytes]] = []
        try:
            self.evict(sum(item[4] for item in todo))
            for meta, checksum, prefix, buffers, size in todo:
                path = block_path(self.directory, meta.block_hash)
                lock = self._lock
                assert lock is not None, "start() takes the writer lock before any write"
                try:
                    tmp = write_temp(lock, path, prefix, buffers, self.fsync)
                except FileNotFoundError:
                    make_private_dir(path.parent)
                    tmp = write_temp(lock, path, prefix, buffers, self.fsync)
                temps.append((tmp, meta, size, checksum))
            written = self._commit(temps, touches)
        except (OSError, sqlite3.Error) as exc:
            for tmp, *_ in temps:
                unlink_quiet(tmp)
            self._fail(exc, len(todo))
        with self.counters.lock:
            self.counters.stats.blocks_written += len(written)
            self.counters.stats.bytes_written += sum(size for _, size, _ in written)
        try:
            self.evict(0)  # other processes may have added bytes meanwhile
        except sqlite3.Error as exc:
            self._fail(exc, 0)

    def _commit(
        self, temps: list[tuple[Path, BlockMeta, int, bytes]], touches: set[bytes]
    ) -> list[tuple[BlockMeta, int, bytes]]:
        """Rename the files into place and insert their rows, in one transaction."""
        written: list[tuple[BlockMeta, int, bytes]] = []
        with self.index.transaction():
            try:
                raced = self.index.present([meta.block_hash for _, meta, _, _ in temps], None)
                for tmp, meta, size, checksum in temps:
                    if meta.block_hash in raced:  # another process stored it since we looked
                        unlink_quiet(tmp)
                        continue
                    os.replace(tmp, block_path(self.directory, meta.block_hash))
                    written.append((meta, size, checksum))
                self.index.upsert(written, touches)
            except BaseException:
                for meta, _, _ in written:  # their rows roll back: so must their files
                    unlink_quiet(block_path(self.directory, meta.block_hash))
                raise
        return written

    def evict(self, incoming_bytes: int) -> None:
        """Make room for `incoming_bytes` of this namespace: rows and files in one transaction."""
        with self.index.transaction():
            victims = self.index.evict(
                self.capacity_bytes,
                incoming_bytes,
                self.namespace,
                self.quota_bytes,
                incoming_bytes,
                self.leased.snapshot(),
                int(self.leased.max_fraction * self.capacity_bytes),
            )
            for version, h in victims:  # other format versions' blocks too
                unlink_quiet(block_path(self.directory, h, version))
        self.counters.add("evictions", len(victims))

    def _fail(self, exc: Exception, num_blocks: int) -> NoReturn:
        self.counters.add("writes_dropped", num_blocks)
        if is_disabling(exc):
            self.disable(exc)
        else:
            log.warning("SSD cache %s: write failed (%s); blocks dropped", self.directory, exc)
            self.counters.add("errors")
        raise _BatchFailed from exc

    def disable(self, exc: BaseException, permanent: bool = False) -> None:
        """Pause writes (see the module docstring): one warning per outage; reads go on."""
        now = time.monotonic()
        with self._cond:
            first = self.writes_off is None
            if not first:
                self._retry_s = min(RETRY_MAX_S, self._retry_s * 2)
            self.writes_off = str(exc)
            self._retry_at = None if permanent else now + self._retry_s
            self._drop_pending()
            self._cond.notify_all()
        if not first:
            return
        self.counters.add("errors")
        log.warning(
            "SSD cache %s: writes disabled (%s); stored blocks are still served. %s",
            self.directory,
            exc,
            "Fix the directory and restart to write again."
            if permanent
            else f"Retrying by itself, first in {self._retry_s:g} s, backing off to "
            f"{RETRY_MAX_S:g} s: free disk space or fix permissions.",
        )

    def _resume(self) -> None:
        """A batch landed while writes were paused: they are on again."""
        with self._cond:
            if self.writes_off is None:
                return
            was, self.writes_off, self._retry_at = self.writes_off, None, None
            self._retry_s = RETRY_FIRST_S
        self.counters.add("writes_resumed")
        log.warning("SSD cache %s: writes resumed (they stopped on: %s)", self.directory, was)
