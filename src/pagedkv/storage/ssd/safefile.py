"""Opening the SSD directory's own files as files that anyone with write access made.

The directory is private (`ssd_ownership`), but its user's other programs, a
restored backup or a careless `ln -s` can leave anything there, and a tier that
hangs or dies at start-up on it takes the server with it. So every file the
tier reads (block files, `seed`, `read_path.json`) is opened the one way here:
- the last path component is never followed when it is a symbolic link
  (O_NOFOLLOW: a link could make the tier read, and serve, a file elsewhere);
- the open never waits (O_NONBLOCK: a FIFO with no writer would block
  `open(2)` forever, a tty or device may block or be taken as the controlling
  terminal, O_NOCTTY), and the descriptor must then be a regular file (fstat,
  after the open, so nothing can swap the file between the check and the read);
- its size is bounded before any buffer is taken for it.
What fails any of these is a `BadCacheFileError`, a `CacheCorruptionError`: a
block file that is one is a miss and is deleted like a corrupt one, and the
other files' readers say what they do with it. JSON is decoded totally: any
bytes give a value or that error, never `RecursionError` (deep nesting),
an infinite float (`1e999`) or `NaN`.

Files the tier creates are created with O_CREAT|O_EXCL|O_NOFOLLOW (`CREATE_FLAGS`),
so a file or link already at a temporary name is never written through.
Rejected: `os.path.islink`/`isfile` before a plain open: the check and the
open see different files when one is swapped between them, and `isfile`
follows links.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
from pathlib import Path

from pagedkv.errors import CacheCorruptionError

MAX_BLOCK_FILE_BYTES = 4 << 30  # a 1024-token block of a 13B model's float32 KV is 1.6 GiB
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class BadCacheFileError(CacheCorruptionError):
    """A file of the SSD cache directory that pagedkv cannot have written: a link, a
    FIFO, a device or directory, a file over its size bound, or unparseable JSON."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = path
        super().__init__(
            f"{path} {problem}, which is not a file pagedkv writes there; "
            "remove it (it is ignored meanwhile)"
        )


def _kind(mode: int) -> str:
    for test, name in [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")]:  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, max_bytes: int) -> tuple[int, int]:
    """A read-only descriptor of the regular file at `path`, and its size, at most
    `max_bytes`. Raises FileNotFoundError, BadCacheFileError, or OSError (EACCES, EIO)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadCacheFileError(path, "is a symbolic link") from None
        if exc.errno == errno.ENXIO:  # a socket, or a device with no driver behind it
            raise BadCacheFileError(path, "is a socket or device") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadCacheFileError(path, f"is {_kind(st.st_mode)}")
        if st.st_size > max_bytes:
            raise BadCacheFileError(path, f"is {st.st_size} bytes, over its bound of {max_bytes}")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)  # reads of a regular file then block as usual
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_small(path: Path, max_bytes: int) -> bytes:
    """The whole of a small regular file (`open_regular`'s rules), at most `max_bytes`
    even if it grows while read."""
    fd, _ = open_regular(path, max_bytes)
    try:
        chunks, total = [], 0
        while chunk := os.read(fd, max_bytes + 1 - total):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise BadCacheFileError(path, f"grew past its bound of {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]!r} is out of range")
    return value


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number")


def load_json(path: Path, max_bytes: int) -> object:
    """The JSON value in the file at `path` (`read_small`'s rules). Any bytes give a value
    or BadCacheFileError (also FileNotFoundError, OSError from the read): floats are
    finite, NaN and Infinity are refused, nesting too deep for the parser is an error."""
    raw = read_small(path, max_bytes)
    try:
        return json.loads(raw, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, digits
        raise BadCacheFileError(path, f"is not valid JSON ({type(exc).__name__})") from None


def is_regular_or_missing(path: Path) -> bool:
    """Whether `path` is absent or a regular file, itself not a link (lstat). For files
    another library opens by name (SQLite's); the tier's own reads use `open_regular`."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True
