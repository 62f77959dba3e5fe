"""The SQL of one format version's index tables (see `ssd_versions` for their names).

For version "1" the names are those from before versions were namespaced
(`blocks`, `usage`, `blocks_parent`, ...), so an existing index is used as it is.
"""

from __future__ import annotations

from pagedkv.storage.ssd.versions import VersionTables


def schema(t: VersionTables) -> str:
    """CREATE ... IF NOT EXISTS for `t`'s tables, indexes and triggers, and the shared clock."""
    b, u = t.blocks, t.usage
    return f"""
CREATE TABLE IF NOT EXISTS {b} (
    hash BLOB PRIMARY KEY,
    parent_hash BLOB NOT NULL,
    namespace TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    num_bytes INTEGER NOT NULL,
    checksum BLOB NOT NULL,
    last_access REAL NOT NULL,
    token_ids BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS clock (id INTEGER PRIMARY KEY CHECK (id = 0), tick INTEGER NOT NULL);
INSERT OR IGNORE INTO clock
    SELECT 0, CAST(COALESCE(MAX(last_access), 0) AS INTEGER) + 1 FROM {b};
CREATE INDEX IF NOT EXISTS {b}_parent ON {b}(parent_hash);
CREATE INDEX IF NOT EXISTS {b}_access ON {b}(last_access);
CREATE INDEX IF NOT EXISTS {b}_ns_access ON {b}(namespace, last_access);
CREATE TABLE IF NOT EXISTS {u} (
    namespace TEXT PRIMARY KEY,
    num_blocks INTEGER NOT NULL,
    num_bytes INTEGER NOT NULL
);
-- A plain INSERT ... WHERE NOT EXISTS, not INSERT OR IGNORE: inside a trigger the
-- outer statement's conflict policy (the upsert's) would override the IGNORE.
CREATE TRIGGER IF NOT EXISTS {b}_insert AFTER INSERT ON {b} BEGIN
    INSERT INTO {u} SELECT NEW.namespace, 0, 0
        WHERE NOT EXISTS (SELECT 1 FROM {u} WHERE namespace = NEW.namespace);
    UPDATE {u} SET num_blocks = num_blocks + 1, num_bytes = num_bytes + NEW.num_bytes
        WHERE namespace = NEW.namespace;
END;
CREATE TRIGGER IF NOT EXISTS {b}_delete AFTER DELETE ON {b} BEGIN
    UPDATE {u} SET num_blocks = num_blocks - 1, num_bytes = num_bytes - OLD.num_bytes
        WHERE namespace = OLD.namespace;
END;
CREATE TRIGGER IF NOT EXISTS {b}_update AFTER UPDATE OF namespace, num_bytes ON {b} BEGIN
    UPDATE {u} SET num_blocks = num_blocks - 1, num_bytes = num_bytes - OLD.num_bytes
        WHERE namespace = OLD.namespace;
    INSERT INTO {u} SELECT NEW.namespace, 0, 0
        WHERE NOT EXISTS (SELECT 1 FROM {u} WHERE namespace = NEW.namespace);
    UPDATE {u} SET num_blocks = num_blocks + 1, num_bytes = num_bytes + NEW.num_bytes
        WHERE namespace = NEW.namespace;
END;
"""


def upsert_sql(t: VersionTables) -> str:
    return f"""
INSERT INTO {t.blocks} VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT(hash) DO UPDATE SET
    parent_hash = excluded.parent_hash, namespace = excluded.namespace,
    num_tokens = excluded.num_tokens, num_bytes = excluded.num_bytes,
    checksum = excluded.checksum, last_access = excluded.last_access,
    token_ids = excluded.token_ids
"""
