"""The SSD store's SQLite index: one row per block file, shared by every process.

Invariants:
- A block file is renamed into place, and its row inserted, in one write
  transaction; its row is deleted and its file unlinked in one write
  transaction too (see `transaction`). SQLite's write lock thus serialises
  every rename and unlink across processes, so at each commit a row names an
  existing file. Only a crash (or a hand edit) can leave a row without its
  file, which readers treat as a miss, or a file without a row, which start-up
  and `check` re-index or delete.
- `usage` holds, per namespace, the count and byte sum of `blocks`, kept
  exact by triggers in the same transaction, so the capacity check on every
  write reads a few rows instead of summing the whole table.
- `last_access` is a tick of the directory's logical clock (table `clock`,
  one counter advanced by every write transaction that stores or touches
  blocks), so LRU order survives restarts and no clock step can reorder it.
  Wall-clock time was rejected: stepping the clock back a day made every new
  block look older than every old one. A database from before the counter
  starts it above its largest wall-clock `last_access`, so its rows stay older.
- Each block-file format version has tables of its own (`ssd_versions`):
  every query here sees this version's rows only, but the capacity count
  and LRU eviction cover every version's.
- Connections run with `trusted_schema=OFF`: the file may have been edited by
  someone else, and its triggers and views then must not call functions
  with side effects.

One connection per thread (`threading.local`), reopened in a forked child.
WAL mode lets readers run while a writer commits; write transactions start
with BEGIN IMMEDIATE so two processes queue on `busy_timeout` instead of
failing a read-to-write upgrade with SQLITE_BUSY.
"""

from __future__ import annotations

import heapq
import os
import sqlite3
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.storage.base import BlockMeta
from pagedkv.storage.ssd.ownership import create_private
from pagedkv.storage.ssd.schema import schema, upsert_sql
from pagedkv.storage.ssd.versions import current_version, other_versions, tables_for

BUSY_TIMEOUT_MS = 10_000
_CHUNK = 500  # SQLite caps bound variables (32766 here, 999 in old builds)


@dataclass(slots=True)
class IndexRow:
    namespace: str
    num_bytes: int
    checksum: bytes


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    num_blocks: int
    num_bytes: int


def _chunks(items: Sequence[bytes]) -> Iterator[Sequence[bytes]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def _tagged(version: str, rows: sqlite3.Cursor) -> Iterator[tuple[float, str, bytes, int]]:
    """`(last_access, version, hash, num_bytes)` rows, in the cursor's (access) order."""
    for last_access, block_hash, num_bytes in rows:
        yield last_access, version, block_hash, num_bytes


def _pick_lru(
    candidates: Iterator[tuple[float, str, bytes, int]],
    excess: int,
    leased: Collection[bytes] = (),
    max_leased_bytes: int = 0,
) -> list[tuple[str, bytes]]:
    """`(version, hash)` of the oldest candidates whose bytes cover `excess`. Blocks in
    `leased` are passed over, up to `max_leased_bytes` of them, and taken last (oldest
    first) only if the others do not cover `excess`: a lease keeps at most that much."""
    victims: list[tuple[str, bytes]] = []
    kept: list[tuple[str, bytes, int]] = []
    kept_bytes = 0
    for _, version, block_hash, num_bytes in candidates:
        if excess <= 0:
            break
        if block_hash in leased and kept_bytes + num_bytes <= max_leased_bytes:
            kept.append((version, block_hash, num_bytes))
            kept_bytes += num_bytes
            continue
        victims.append((version, block_hash))
        excess -= num_bytes
    for version, block_hash, num_bytes in kept:
        if excess <= 0:
            break
        victims.append((version, block_hash))
        excess -= num_bytes
    return victims


def _delete_rows(conn: sqlite3.Connection, victims: list[tuple[str, bytes]]) -> None:
    for version in {v for v, _ in victims}:
        table = tables_for(version).blocks
        conn.executemany(
            f"DELETE FROM {table} WHERE hash = ?", [(h,) for v, h in victims if v == version]
        )


class SSDIndex:
    """Typed queries over `<dir>/index.sqlite`. Every method is one short transaction."""

    def __init__(self, path: Path, read_only: bool = False, version: str | None = None) -> None:
        self.path = path
        self.read_only = read_only
        self.version = current_version() if version is None else version
        self._t = tables_for(self.version)
        self._upsert = upsert_sql(self._t)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        try:
            if not read_only and str(path) != ":memory:":
                create_private(path)
            conn = self._conn()
            if not read_only and str(path) != ":memory:":
                self._initialise(conn)
        except BaseException:
            self.close()
            raise

    def _initialise(self, conn: sqlite3.Connection) -> None:
        """WAL mode and this version's tables, retried while another process does the same.

        Switching a new (empty, rollback-mode) database to WAL takes an exclusive
        lock, and SQLite fails it at once with "database is locked", without
        waiting on `busy_timeout`, when other processes open the same new file at
        that moment (1-13 in 400 opens, four processes at a time, in a test). Two
        engines started together on a new directory hit exactly that.
        """
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        pause = 0.005
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.executescript("BEGIN IMMEDIATE;" + schema(self._t) + "COMMIT;")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                    raise
                with suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _connect(self) -> sqlite3.Connection:
        if self.read_only:
            # A read-only directory cannot hold the WAL's -shm file; `immutable`
            # reads the database file as it is, which is all a read-only disk offers.
            uri = f"file:{self.path}?mode=ro"
            try:
                conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=1.0)
                conn.execute(f"SELECT 1 FROM {self._t.blocks} LIMIT 1")
            except sqlite3.Error:
                uri += "&immutable=1"
                conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=1.0)
        else:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
            # NORMAL in WAL mode survives a process crash; a power loss may lose the
            # last commits, which only turns their blocks into files without rows.
            conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA trusted_schema=OFF")
        if str(self.path) == ":memory:":  # every thread's connection is a database of its own
            conn.executescript(schema(self._t))
        return conn

    def _conn(self) -> sqlite3.Connection:
        local = self._local
        if getattr(local, "pid", None) != os.getpid():
            local.conn = self._connect()  # a forked child never reuses the parent's handle
            local.pid = os.getpid()
            with self._all_lock:
                self._all.append(local.conn)
        conn: sqlite3.Connection = local.conn
        return conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; calls made inside it (this thread) join it.

        Every rename of a block file into place and every unlink of one happens
        inside such a transaction, together with its row's insert or delete, so
        these are serialised across processes by SQLite's write lock and a row
        and its file never disagree at a commit (a crash aside).
        """
        conn = self._conn()
        if conn.in_transaction:
            yield conn
            return
        conn.execute("BEGIN" if self.read_only else "BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        with self._all_lock:
            conns, self._all = self._all, []
        for conn in conns:
            with suppress(sqlite3.Error):
                conn.close()
        self._local = threading.local()

    # ---- reads ----

    def lookup(self, hashes: Sequence[bytes]) -> dict[bytes, IndexRow]:
        conn = self._conn()
        found: dict[bytes, IndexRow] = {}
        for part in _chunks(hashes):
            marks = ",".join("?" * len(part))
            query = (
                f"SELECT hash, namespace, num_bytes, checksum FROM {self._t.blocks} "
                f"WHERE hash IN ({marks})"
            )
            for h, ns, size, checksum in conn.execute(query, part):
                found[h] = IndexRow(ns, size, checksum)
        return found

    def present(self, hashes: Sequence[bytes], namespace: str | None) -> set[bytes]:
        conn = self._conn()
        found: set[bytes] = set()
        for part in _chunks(hashes):
            marks = ",".join("?" * len(part))
            if namespace is None:
                rows = conn.execute(
                    f"SELECT hash FROM {self._t.blocks} WHERE hash IN ({marks})", part
                )
            else:
                query = (
                    f"SELECT hash FROM {self._t.blocks} WHERE hash IN ({marks}) AND namespace = ?"
                )
                rows = conn.execute(query, [*part, namespace])
            found.update(h for (h,) in rows)
        return found

    def children(self, parent_key: bytes, namespace: str) -> list[BlockMeta]:
        rows = self._conn().execute(
            f"SELECT hash, token_ids FROM {self._t.blocks} WHERE parent_hash = ? AND namespace = ?",
            (parent_key, namespace),
        )
        return [
            BlockMeta(h, parent_key, np.frombuffer(tokens, dtype="<i4").astype(np.int32), namespace)
            for h, tokens in rows
        ]

    def usage(self) -> dict[str, NamespaceUsage]:
        rows = self._conn().execute(
            f"SELECT namespace, num_blocks, num_bytes FROM {self._t.usage} WHERE num_blocks > 0"
        )
        return {ns: NamespaceUsage(n, size) for ns, n, size in rows}

    def other_versions_usage(self) -> dict[str, NamespaceUsage]:
        """Blocks and bytes of every other format version in the directory, by version:
        invisible to this one, but counted in its capacity (`ssd_versions`)."""
        conn = self._conn()
        found = {}
        for t in other_versions(conn, self.version):
            n, size = conn.execute(
                f"SELECT COALESCE(SUM(num_blocks), 0), COALESCE(SUM(num_bytes), 0) FROM {t.usage}"
            ).fetchone()
            if n:
                found[t.version] = NamespaceUsage(int(n), int(size))
        return found

    def tokens_per_namespace(self) -> dict[str, int]:
        """Cached tokens by namespace; a scan of every row (maintenance only)."""
        rows = self._conn().execute(
            f"SELECT namespace, SUM(num_tokens) FROM {self._t.blocks} GROUP BY namespace"
        )
        return {ns: int(n) for ns, n in rows}

    def all_rows(self) -> dict[bytes, IndexRow]:
        rows = self._conn().execute(
            f"SELECT hash, namespace, num_bytes, checksum FROM {self._t.blocks}"
        )
        return {h: IndexRow(ns, size, checksum) for h, ns, size, checksum in rows}

    def hashes(self, namespace: str | None = None) -> list[bytes]:
        conn = self._conn()
        if namespace is None:
            return [h for (h,) in conn.execute(f"SELECT hash FROM {self._t.blocks}")]
        return [
            h
            for (h,) in conn.execute(
                f"SELECT hash FROM {self._t.blocks} WHERE namespace = ?", (namespace,)
            )
        ]

    # ---- writes ----

    def upsert(
        self, metas: Iterable[tuple[BlockMeta, int, bytes]], touches: Iterable[bytes] = ()
    ) -> None:
        """Insert rows for written files `(meta, file bytes, checksum)`; touch `touches`.
        All of them get the clock's next tick."""
        metas = list(metas)
        touches = list(touches)
        if not metas and not touches:
            return
        with self.transaction() as conn:
            now = self._tick(conn)
            self._write_rows(conn, metas, touches, now)

    @staticmethod
    def _tick(conn: sqlite3.Connection) -> int:
        """Advance the logical clock; inside the caller's write transaction."""
        conn.execute("UPDATE clock SET tick = tick + 1 WHERE id = 0")
        row = conn.execute("SELECT tick FROM clock WHERE id = 0").fetchone()
        return int(row[0]) if row else 0

    def clock(self) -> int:
        """The current tick (the last access of the most recently used block)."""
        row = self._conn().execute("SELECT tick FROM clock WHERE id = 0").fetchone()
        return int(row[0]) if row else 0

    def _write_rows(
        self,
        conn: sqlite3.Connection,
        metas: list[tuple[BlockMeta, int, bytes]],
        touches: list[bytes],
        now: int,
    ) -> None:
        rows = [
            (
                m.block_hash,
                m.parent_key,
                m.namespace,
                m.num_tokens,
                size,
                checksum,
                now,
                np.ascontiguousarray(m.token_ids, dtype="<i4").tobytes(),
            )
            for m, size, checksum in metas
        ]
        touched = [(now, h) for h in touches]
        conn.executemany(self._upsert, rows)
        conn.executemany(f"UPDATE {self._t.blocks} SET last_access = ? WHERE hash = ?", touched)

    def insert_row(self, meta: BlockMeta, size: int, checksum: bytes, last_access: int = 0) -> None:
        """A row for a file found on disk; access tick 0 by default, so it ages out first."""
        tokens = np.ascontiguousarray(meta.token_ids, dtype="<i4").tobytes()
        row = (meta.block_hash, meta.parent_key, meta.namespace, meta.num_tokens)
        with self.transaction() as conn:
            conn.execute(self._upsert, (*row, size, checksum, last_access, tokens))

    def delete(self, hashes: Sequence[bytes]) -> None:
        with self.transaction() as conn:
            conn.executemany(f"DELETE FROM {self._t.blocks} WHERE hash = ?", [(h,) for h in hashes])

    def delete_namespace(self, namespace: str | None) -> list[bytes]:
        """Delete every row (of one namespace); returns the hashes deleted."""
        with self.transaction() as conn:
            if namespace is None:
                gone = [h for (h,) in conn.execute(f"SELECT hash FROM {self._t.blocks}")]
                conn.execute(f"DELETE FROM {self._t.blocks}")
            else:
                query = f"SELECT hash FROM {self._t.blocks} WHERE namespace = ?"
                gone = [h for (h,) in conn.execute(query, (namespace,))]
                conn.execute(f"DELETE FROM {self._t.blocks} WHERE namespace = ?", (namespace,))
        return gone

    def evict(
        self,
        capacity_bytes: int,
        incoming_bytes: int = 0,
        namespace: str | None = None,
        quota_bytes: int | None = None,
        incoming_ns_bytes: int = 0,
        leased: Collection[bytes] = (),
        max_leased_bytes: int = 0,
    ) -> list[tuple[str, bytes]]:
        """Delete least recently used rows until `incoming_bytes` more fit.

        First within `namespace` down to `quota_bytes - incoming_ns_bytes`, then
        across the whole directory, other format versions' rows included (they
        share its capacity, see `ssd_versions`), down to `capacity_bytes -
        incoming_bytes`. Leased blocks go last (`_pick_lru`). Returns `(format
        version, hash)` of each evicted row; the caller unlinks their files before
        this commit (row and file go together, under the write lock, so no reader
        trusts a half-deleted block).
        """
        evicted: list[tuple[str, bytes]] = []
        mine = self._t
        with self.transaction() as conn:
            if namespace is not None and quota_bytes is not None:
                row = conn.execute(
                    f"SELECT num_bytes FROM {mine.usage} WHERE namespace = ?", (namespace,)
                ).fetchone()
                excess = (row[0] if row else 0) + incoming_ns_bytes - quota_bytes
                query = (
                    f"SELECT last_access, hash, num_bytes FROM {mine.blocks} "
                    "WHERE namespace = ? ORDER BY last_access"
                )
                cursor = conn.execute(query, (namespace,))
                victims = _pick_lru(_tagged(mine.version, cursor), excess, leased, max_leased_bytes)
                cursor.close()  # before the deletes below change the rows it walks
                _delete_rows(conn, victims)
                evicted += victims
            versions = [mine, *other_versions(conn, self.version)]
            total = sum(
                conn.execute(f"SELECT COALESCE(SUM(num_bytes), 0) FROM {t.usage}").fetchone()[0]
                for t in versions
            )
            excess = total + incoming_bytes - capacity_bytes
            if excess > 0:
                # One indexed scan per version, merged: a UNION ALL ... ORDER BY would
                # sort every row of the directory on each eviction.
                cursors = [
                    conn.execute(
                        f"SELECT last_access, hash, num_bytes FROM {t.blocks} ORDER BY last_access"
                    )
                    for t in versions
                ]
                tagged = [_tagged(t.version, c) for t, c in zip(versions, cursors, strict=True)]
                merged = heapq.merge(*tagged)
                victims = _pick_lru(merged, excess, leased, max_leased_bytes)
                for cursor in cursors:
                    cursor.close()
                _delete_rows(conn, victims)
                evicted += victims
        return evicted

    def rebuild_usage(self) -> None:
        """Recompute `usage` from `blocks` (after a crash or hand edits; triggers keep it exact)."""
        with self.transaction() as conn:
            conn.execute(f"DELETE FROM {self._t.usage}")
            conn.execute(
                f"INSERT INTO {self._t.usage} SELECT namespace, COUNT(*), SUM(num_bytes) "
                f"FROM {self._t.blocks} GROUP BY namespace"
            )
