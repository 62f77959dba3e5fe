"""How several block-file format versions share one SSD cache directory.

A rolling upgrade runs two versions of pagedkv on one directory at once. Each
format version owns a namespace of its own there, so neither takes the
other's entries for corrupt and deletes them:
- files: version "1" (the layout from before versions were namespaced) in
  `<root>/blocks/<hh>/<hh>/`, every later version V in
  `<root>/blocks/v<V>/<hh>/<hh>/`, leaf names `<hash hex>.safetensors`;
- index rows: version "1" in tables `blocks` and `usage`, version V in
  `blocks_v<V>` and `usage_v<V>`, all in the one `index.sqlite`, sharing its
  `clock` table, so last-access ticks compare across versions.
Another version's files and rows are invisible to this one (no lookup, read,
re-index or `check` looks at them), but they count toward the directory's
`capacity_bytes` and are evicted by LRU like this version's own, which is why
this contract is frozen: a later version may change its file format and its
row columns, but keeps these names and the columns `hash`, `num_bytes` and
`last_access` in its blocks table and `num_bytes` in its usage table.

Rejected: a version column in the one `blocks` table. A process from before
the change inserts 8 values into it (`INSERT INTO blocks VALUES (...)`), so
adding a column would break every writer not yet upgraded, and the hash
primary key would still make two versions' rows for one block replace each
other.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from pagedkv.storage.ssd import format as block_format

LEGACY_VERSION = "1"
_VERSION_RE = re.compile(r"[0-9A-Za-z]{1,16}")
_TABLE_RE = re.compile(r"blocks_v([0-9A-Za-z]{1,16})")
_REQUIRED_COLUMNS = {"hash", "num_bytes", "last_access"}


@dataclass(frozen=True, slots=True)
class VersionTables:
    """One format version's share of the directory: its tables and its file tree."""

    version: str
    blocks: str
    usage: str


def current_version() -> str:
    return block_format.FORMAT_VERSION


def tables_for(version: str) -> VersionTables:
    if not _VERSION_RE.fullmatch(version):
        raise ValueError(
            f"SSD format version {version!r} is not 1-16 letters or digits; "
            "it names index tables and a directory"
        )
    if version == LEGACY_VERSION:
        return VersionTables(version, "blocks", "usage")
    return VersionTables(version, f"blocks_v{version}", f"usage_v{version}")


def version_tree(root: Path, version: str | None = None) -> Path:
    """The directory holding `version`'s leaf directories (this version's by default)."""
    version = current_version() if version is None else version
    if version == LEGACY_VERSION:
        return root / "blocks"
    return root / "blocks" / f"v{version}"


def is_version_dir(name: str) -> bool:
    """Whether `name`, directly under `<root>/blocks/`, is a later version's tree."""
    return name.startswith("v") and bool(_VERSION_RE.fullmatch(name[1:]))


def block_path(root: Path, block_hash: bytes, version: str | None = None) -> Path:
    """`<version tree>/<hh>/<hh>/<hash hex>.safetensors`; 65536 leaf directories at most."""
    hexed = block_hash.hex()
    return version_tree(root, version) / hexed[:2] / hexed[2:4] / (hexed + block_format.SUFFIX)


def other_versions(conn: sqlite3.Connection, mine: str) -> list[VersionTables]:
    """Every other version with a blocks table in this index that keeps the contract.

    A table missing the contract's columns is left alone (not ours to judge),
    and so are its bytes: only a version that can be evicted is counted.
    """
    found = []
    names = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' "
        "AND (name = 'blocks' OR name GLOB 'blocks_v*')"
    )
    for (name,) in names.fetchall():
        match = _TABLE_RE.fullmatch(name)
        version = LEGACY_VERSION if name == "blocks" else (match.group(1) if match else None)
        if version is None or version == mine:
            continue
        tables = tables_for(version)
        columns = {row[1] for row in conn.execute(f"PRAGMA table_info({tables.blocks})")}
        usage_columns = {row[1] for row in conn.execute(f"PRAGMA table_info({tables.usage})")}
        if columns >= _REQUIRED_COLUMNS and "num_bytes" in usage_columns:
            found.append(tables)
    return found
