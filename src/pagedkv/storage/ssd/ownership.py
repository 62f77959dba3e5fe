"""Who may touch an SSD cache directory, and which temporary files are whose.

The directory holds every tenant's token ids in plain text and KV that engines
serve, so it is private to the user running pagedkv: directories are created
0700 and files 0600, whatever the umask, and an existing directory that another
user owns or that others may write is refused (`UnsafeCacheDirectoryError`).
One that others may only read is used, with a warning.

Temporary files belong to a writer, not to a pid: each `BlockWriter` holds an
exclusive `flock` on its own `locks/<writer id>.lock` for its whole life and
names its temporaries `<final>.tmp-<writer id>-<random>`. A temporary is stale
exactly when its writer's lock can be taken (the writer is gone: flock locks die
with their last descriptor, also in another container sharing the volume, where
pids mean nothing). The rejected alternative, the pid in the name, deletes a live
writer's files whenever another pid namespace reuses its number. Temporaries
named by a pid (written before this scheme) are stale after an hour.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from pagedkv.errors import PagedKVError
from pagedkv.storage.ssd.safefile import CREATE_FLAGS

log = logging.getLogger("pagedkv.storage.ssd")

TEMP_MARK = ".tmp-"
LOCKS_DIR = "locks"
LOCK_SUFFIX = ".lock"
LEGACY_STALE_S = 3600.0
DIR_MODE = 0o700
FILE_MODE = 0o600


# What a writer to an SSD cache directory can do (`check_directory`'s default).
_SSD = ("SSD cache directory", "make engines serve forged KV")


class UnsafeCacheDirectoryError(PagedKVError):
    """A cache directory may be written by someone else than its user."""

    def __init__(self, path: Path, problem: str, fix: str, what: tuple[str, str] = _SSD) -> None:
        self.path = path
        kind, harm = what
        super().__init__(
            f"refusing {kind} {path}: {problem}; anyone who can write there can "
            f"{harm}. Fix: {fix}, or pick a directory of your own"
        )


def check_directory(path: Path, what: tuple[str, str] = _SSD) -> None:
    """Refuse an existing directory owned by another user or writable by group or
    others; `what`: the directory's kind and what a writer to it could do."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheDirectoryError(path, "it is not a directory", f"remove {path}", what)
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeCacheDirectoryError(
            path, f"it is owned by uid {st.st_uid}, not by this user (uid {me})",
            f"chown {me} {path} && chmod 700 {path}", what,
        )  # fmt: skip
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafeCacheDirectoryError(
            path, f"its mode is {mode:04o}, writable by group or others", f"chmod 700 {path}",
            what,
        )  # fmt: skip
    if what != _SSD:
        return
    if mode & 0o055:
        log.warning(
            "SSD cache directory %s has mode %04o: other users can read the cached token ids "
            "of every tenant. Fix: chmod 700 %s",
            path, mode, path,
        )  # fmt: skip


def make_private_dir(path: Path) -> None:
    """Create `path` and any missing parents below an existing ancestor, each 0700."""
    missing = []
    probe = path
    while not probe.exists():
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, DIR_MODE)
            os.chmod(directory, DIR_MODE)  # the umask may have taken the owner's bits too


def create_private(path: Path) -> None:
    """Create an empty file 0600 unless it exists (the index, before SQLite opens it,
    so that its -wal and -shm files, which SQLite creates with the same mode, are 0600 too)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, CREATE_FLAGS, FILE_MODE))


class WriterLock:
    """An exclusive flock on `<root>/locks/<writer id>.lock`, held until `release`."""

    def __init__(self, root: Path) -> None:
        self.writer_id = "w" + os.urandom(8).hex()
        self._path = root / LOCKS_DIR / (self.writer_id + LOCK_SUFFIX)
        self._fd: int | None = None
        try:
            make_private_dir(self._path.parent)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self._path, flags, FILE_MODE)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._fd = fd
        except OSError:
            pass  # a read-only directory: nothing will be written, so nothing to own

    def temp_name(self, final: Path) -> Path:
        return final.with_name(f"{final.name}{TEMP_MARK}{self.writer_id}-{os.urandom(4).hex()}")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self._path)
        os.close(self._fd)
        self._fd = None


def _lock_is_free(lock_path: Path) -> bool:
    """True when nobody holds the writer lock at `lock_path` (or it does not exist, or
    is no lock a writer made: a link or a FIFO, which is opened without waiting)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError as exc:
        return exc.errno in (errno.ELOOP, errno.ENXIO)  # else cannot tell: keep the file
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return True
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def is_stale_temp(root: Path, path: Path) -> bool:
    """Whether the temporary file at `path` belongs to no live writer."""
    owner = path.name.rpartition(TEMP_MARK)[2].partition("-")[0]
    if owner.startswith("w"):
        return _lock_is_free(root / LOCKS_DIR / (owner + LOCK_SUFFIX))
    with contextlib.suppress(OSError):
        return time.time() - os.lstat(path).st_mtime > LEGACY_STALE_S
    return False


def stale_locks(root: Path) -> list[Path]:
    """Lock files no writer holds (left by writers that died); safe to delete."""
    try:
        entries = list(os.scandir(root / LOCKS_DIR))
    except OSError:
        return []
    return [
        Path(e.path)
        for e in entries
        if e.name.endswith(LOCK_SUFFIX) and _lock_is_free(Path(e.path))
    ]


def write_temp(
    lock: WriterLock, path: Path, prefix: bytes, buffers: list[memoryview], fsync: bool
) -> Path:
    """Write `prefix + buffers` to a new temporary name (mode 0600) beside `path`; return it.

    The caller renames it into place (atomic: readers and a crash see the whole
    file or none). Without `fsync`, a power loss can leave a renamed file with
    missing data; the checksum turns that into a miss, never a wrong hit.
    """
    tmp = lock.temp_name(path)
    fd = os.open(tmp, CREATE_FLAGS, FILE_MODE)
    try:
        try:
            for chunk in [memoryview(prefix), *buffers]:
                done = 0
                while done < chunk.nbytes:
                    done += os.write(fd, chunk[done:])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp
