"""What each namespace of an SSD cache directory holds, for people: `namespaces/<ns>.json`.

A namespace is a digest of the model's identity (`ModelAdapter.fingerprint`), so
`pagedkv cache stats` and `cache clear --model` cannot tell from it alone which
model wrote a block. The store records a small description the first time it
opens a namespace that has none: the model's name, its dtype and weights kernel,
the KV dtype, the block size, the weights digest and when it was first seen.

Choices:
- One file per namespace, written under a temporary name and renamed into
  place, never rewritten while a valid one is there (the first writer's time
  stays "first seen"). Rejected: one JSON file for every namespace, which two
  engines starting together would each read, change and replace, losing one;
  and a table in `index.sqlite`, whose tables belong to block-format versions
  (`ssd_versions`) while a description does not.
- The files are read as untrusted input, like every file of the directory
  (`ssd_safefile`): bounded in size, decoded totally, every field checked; a
  bad one reads as no description ("unknown model"), and the next engine that
  opens the namespace replaces it.
- Descriptions outlive their blocks (a `cache clear` keeps them): a server still
  running on a cleared namespace writes blocks again without re-opening the tier.
- A namespace whose name could not be a file name (anything but letters, digits,
  `_` and `-`, or over 128 characters) gets no description.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import CacheCorruptionError
from pagedkv.storage.ssd.ownership import FILE_MODE, make_private_dir
from pagedkv.storage.ssd.safefile import CREATE_FLAGS, load_json

log = logging.getLogger("pagedkv.storage.ssd")

NAMESPACES_DIR = "namespaces"
MAX_DESCRIPTION_BYTES = 4096
_NAME_RE = re.compile(r"[0-9A-Za-z_-]{1,128}")
_TEXT_FIELDS = ("model", "dtype", "kv_dtype", "weights_kernel")
_MAX_TEXT = 512
UNKNOWN_MODEL = "unknown model (written before this version)"


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """Who wrote a namespace. `weights`: the weights digest (`fingerprint.weights_digest`
    of the model's files), None for a model not loaded from files; `kv_dtype`: how KV is
    stored ("float32", "int8", ...); `first_seen`: Unix time."""

    model: str
    dtype: str
    kv_dtype: str
    block_size: int
    weights_kernel: str = "torch"
    weights: str | None = None
    first_seen: float = 0.0

    def summary(self) -> str:
        # int8 and int4 weights change what the model computes; a packed float kernel
        # only rounds
        bits = next((b for b in ("int8", "int4") if b in self.weights_kernel), None)
        kernel = f", {bits} weights" if bits else ""
        return (
            f"{self.model} ({self.dtype}{kernel}, KV {self.kv_dtype}, "
            f"block {self.block_size} tokens)"
        )


def description_path(root: Path, namespace: str) -> Path | None:
    """Where `namespace`'s description lives; None when its name cannot be a file name."""
    if not _NAME_RE.fullmatch(namespace):
        return None
    return root / NAMESPACES_DIR / f"{namespace}.json"


def read_namespace(root: Path, namespace: str) -> NamespaceInfo | None:
    """The recorded description, or None when there is none or it is not one pagedkv
    wrote (a link, a FIFO, too large, bad JSON, a missing or mistyped field)."""
    path = description_path(root, namespace)
    if path is None:
        return None
    try:
        data = load_json(path, MAX_DESCRIPTION_BYTES)
    except (OSError, CacheCorruptionError):
        return None
    return _parse(data, namespace)


def _parse(data: object, namespace: str) -> NamespaceInfo | None:
    if not isinstance(data, dict) or data.get("namespace") != namespace:
        return None
    text = {k: data.get(k) for k in _TEXT_FIELDS}
    if not all(isinstance(v, str) and 0 < len(v) <= _MAX_TEXT for v in text.values()):
        return None
    block_size, first_seen, weights = (
        data.get("block_size"),
        data.get("first_seen"),
        data.get("weights"),
    )
    if type(block_size) is not int or not 0 < block_size <= 1 << 20:
        return None
    if not isinstance(first_seen, int | float) or isinstance(first_seen, bool):
        return None
    if not 0 <= first_seen < 1e11:
        return None
    if weights is not None and not (isinstance(weights, str) and len(weights) <= _MAX_TEXT):
        return None
    return NamespaceInfo(
        model=str(text["model"]),
        dtype=str(text["dtype"]),
        kv_dtype=str(text["kv_dtype"]),
        block_size=block_size,
        weights_kernel=str(text["weights_kernel"]),
        weights=weights,
        first_seen=float(first_seen),
    )


def record_namespace(root: Path, namespace: str, info: NamespaceInfo) -> bool:
    """Write `info` as `namespace`'s description unless a valid one is there; True when
    written. Never raises for the disk (a read-only or full one leaves it undescribed)."""
    path = description_path(root, namespace)
    if path is None or read_namespace(root, namespace) is not None:
        return False
    fields: dict[str, Any] = {"namespace": namespace, **asdict(info)}
    fields["first_seen"] = info.first_seen or round(time.time(), 3)
    data = json.dumps(fields, indent=1, sort_keys=True).encode()
    if len(data) > MAX_DESCRIPTION_BYTES or _parse(json.loads(data), namespace) is None:
        log.debug("namespace %s: description not recordable: %r", namespace, fields)
        return False
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        make_private_dir(path.parent)
        fd = os.open(tmp, CREATE_FLAGS, FILE_MODE)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        log.debug("namespace %s: description not written (%s)", namespace, exc)
        return False
    return True


def described_namespaces(root: Path, limit: int = 32) -> dict[str, NamespaceInfo | None]:
    """The namespaces with a description file, at most `limit` of them (the most
    recently written first), each with its description (None when unreadable)."""
    folder = root / NAMESPACES_DIR
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith(".json") and e.is_file()]
    except OSError:
        return {}
    entries.sort(key=lambda e: -e.stat(follow_symlinks=False).st_mtime)
    out: dict[str, NamespaceInfo | None] = {}
    for entry in entries:
        name = entry.name[: -len(".json")]
        if _NAME_RE.fullmatch(name) and len(out) < limit:
            out[name] = read_namespace(root, name)
    return out


def description_json(namespace: str, info: NamespaceInfo) -> bytes:
    """`info` as the JSON a description file holds (the Redis tier keeps the same)."""
    fields: dict[str, Any] = {"namespace": namespace, **asdict(info)}
    fields["first_seen"] = info.first_seen or round(time.time(), 3)
    return json.dumps(fields, sort_keys=True).encode()


def description_from_json(raw: bytes, namespace: str) -> NamespaceInfo | None:
    """A description read from elsewhere than a file (Redis): bounded, total."""
    if len(raw) > MAX_DESCRIPTION_BYTES:
        return None
    try:
        return _parse(json.loads(raw), namespace)
    except (ValueError, UnicodeDecodeError):
        return None
