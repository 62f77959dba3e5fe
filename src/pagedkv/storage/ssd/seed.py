"""The hashing seed of an SSD cache directory: `<dir>/seed`, created once, mode 0600.

Block hashes are keyed by a secret seed, so a persistent cache must keep it:
the first engine to use a directory stores its seed there and every later one
adopts it. Creation is atomic: the bytes go to a private temporary file that
is then hard-linked to `seed`, which fails if another process won the race, so
a reader never sees a half-written seed (an O_EXCL create would expose an empty
file between create and write). Filesystems without hard links fall back to
O_CREAT|O_EXCL.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from pagedkv.storage.ssd.safefile import CREATE_FLAGS, BadCacheFileError, read_small

log = logging.getLogger("pagedkv.storage.ssd")

SEED_NAME = "seed"
MAX_SEED_BYTES = 4096  # pagedkv writes 16 bytes


def read_seed(directory: Path) -> bytes | None:
    """The stored seed, or None when there is none (yet). Raises BadCacheFileError
    when `seed` is a link, a FIFO, not a regular file or over `MAX_SEED_BYTES`."""
    try:
        data = read_small(directory / SEED_NAME, MAX_SEED_BYTES)
    except FileNotFoundError:
        return None
    return data or None


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, CREATE_FLAGS, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_or_create_seed(directory: Path, candidate: bytes) -> bytes:
    """The directory's seed; stores `candidate` when there is none.

    A directory that cannot be written, or whose `seed` is not a file pagedkv
    wrote (`ssd_safefile`), returns `candidate` unsaved (with a warning): hashes
    are then stable only for this process.
    """
    if not candidate:
        raise ValueError("the hashing seed must be at least one byte")
    try:
        stored = read_seed(directory)
    except BadCacheFileError as exc:
        log.warning("%s; cached blocks will not be found by later processes", exc)
        return candidate
    if stored is not None:
        return stored
    path = directory / SEED_NAME
    tmp = directory / f".seed.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _write_private(tmp, candidate)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError:  # no hard links here
            with contextlib.suppress(FileExistsError):
                _write_private(path, candidate)
        with contextlib.suppress(OSError):  # make the new name itself durable
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except OSError as exc:
        log.warning(
            "cannot store the hashing seed in %s (%s): cached blocks will not be found "
            "by later processes",
            directory,
            exc,
        )
        return candidate
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    for _ in range(100):  # the fallback's winner may still be writing
        with contextlib.suppress(BadCacheFileError):
            stored = read_seed(directory)
        if stored is not None:
            return stored
        time.sleep(0.01)
    raise OSError(f"seed file {path} stays empty; delete it and restart")
