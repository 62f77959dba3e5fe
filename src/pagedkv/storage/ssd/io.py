"""File reads of the SSD store: fast, verified-size reads (writes and their
lock-owned temporaries are `ownership.py`'s).

Reads fill one freshly allocated, page-aligned tensor per file; a file not in
the page cache is read with O_DIRECT or buffered and dropped from the cache
after (the choice between them is `ssd_reader`'s).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedkv.errors import CacheCorruptionError
from pagedkv.storage.ssd.memory import BlockMemory
from pagedkv.storage.ssd.safefile import MAX_BLOCK_FILE_BYTES, open_regular

_ALIGN = 4096  # O_DIRECT wants buffer, offset and length aligned to the logical block
# Shared by every store of the process: ~90 blocks of 2.9 MiB, more than a 4K-token
# restore holds at once, so a steady stream of restores faults nothing in.
BLOCK_MEMORY = BlockMemory(keep_bytes=256 * 1024**2)
_PAGE = mmap.PAGESIZE


def _load_mincore() -> Callable[[int, int], bool] | None:
    """`cached(fd, size)`: are all of the file's pages in the page cache? (mincore(2))"""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]  # fmt: skip
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    failed = ctypes.c_void_p(-1).value

    def cached(fd: int, size: int) -> bool:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == failed:
            return True  # cannot tell: the buffered read is right either way
        try:
            vec = (ctypes.c_ubyte * ((size + _PAGE - 1) // _PAGE))()
            if libc.mincore(addr, size, vec) != 0:
                return True
            return bool((np.frombuffer(bytes(vec), dtype=np.uint8) & 1).all())
        finally:
            libc.munmap(addr, size)

    return cached


_page_cached = _load_mincore()


def _read_direct(fd: int, view: memoryview, done: int, size: int) -> int:
    """Read `[done, size)` with O_DIRECT, from the aligned offset below `done`.

    O_DIRECT is switched on the open descriptor (F_SETFL), never by reopening the
    path, which a concurrent rename may have pointed at another file meanwhile.
    Returns how far the file was read; `done` unchanged when O_DIRECT is refused.
    """
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        return done  # tmpfs on older kernels, some FUSE filesystems
    pos = done - done % _ALIGN
    try:
        while pos < size:
            n = os.preadv(fd, [view[pos:]], pos)
            if n == 0:
                break
            pos += n
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: alignment this filesystem refuses
            raise
        pos = done
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return max(done, pos)


@dataclass(slots=True)
class FileRead:
    """One block file read whole: its bytes, and whether they came from the disk
    (`cold`: not all of the file was in the page cache), which only such reads
    measure."""

    data: torch.Tensor
    cold: bool


def read_block_file(path: Path, expected_size: int | None = None, direct: bool = True) -> FileRead:
    """The whole file as a uint8 tensor of its own (no zero fill, no copy after the read).

    A file wholly in the page cache (recently written or read) is copied from it
    and left there. Otherwise it comes from the disk one of two ways, both
    without leaving it in the page cache, where the RAM tier's copy would only
    double it:

    - `direct`: O_DIRECT, one request per file straight into the tensor
      (`BLOCK_MEMORY`: huge pages, already faulted in), no page-cache copy. (A
      non-blocking RWF_NOWAIT probe was rejected: its miss starts a readahead
      that the O_DIRECT read then collides with, halving throughput.) Buffered
      when the filesystem refuses O_DIRECT.
    - buffered: one read through the page cache (the kernel's readahead sizes
      the requests), then `POSIX_FADV_DONTNEED` for the file.

    Raises FileNotFoundError, OSError, or CacheCorruptionError when the size is
    not `expected_size` (a truncated or replaced file) or the path is not a
    regular file of at most `MAX_BLOCK_FILE_BYTES` (a link, a FIFO: `ssd_safefile`),
    checked before any memory is taken for it.
    """
    fd, size = open_regular(path, MAX_BLOCK_FILE_BYTES)
    try:
        if expected_size is not None and size != expected_size:
            raise CacheCorruptionError(
                f"block file is {size} bytes, the index says {expected_size}"
            )
        cold = size > 0 and (_page_cached is None or not _page_cached(fd, size))
        padded = BLOCK_MEMORY.take(size + -size % _ALIGN)
        view = padded.numpy().data
        done = 0
        if direct and cold and _page_cached is not None:
            done = _read_direct(fd, view, 0, size)
        buffered = done < size
        while done < size:
            n = os.preadv(fd, [view[done:size]], done)
            if n == 0:
                raise CacheCorruptionError(f"block file shrank while read ({done} of {size})")
            done += n
        if cold and buffered and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return FileRead(padded[:size], cold)
    finally:
        os.close(fd)


def read_file(path: Path, expected_size: int | None = None) -> torch.Tensor:
    """`read_block_file(path, expected_size).data`: O_DIRECT unless the file is cached."""
    return read_block_file(path, expected_size).data
