"""The disk's own sequential read speed, as both SSD benchmarks compare the tier with it.

A large file is read two ways, each after its pages were dropped from the page
cache and checked gone (`mincore`), so neither figure is a page-cache re-read:

- buffered: 8 MiB `readinto` calls through the page cache (the kernel's
  readahead sizes the disk requests);
- O_DIRECT: 8 MiB reads into a buffer on huge pages, as the store reads (on 4
  KiB pages a virtio disk's segment limit splits each read into ~1 MiB
  requests, and the baseline would be slower than the disk is).

Both buffers are faulted in before the clock starts: a fresh 8 MiB buffer per
read (`os.read`) pays page faults the store does not pay, which made the
buffered figure slower than the disk and the limit laxer than it should be.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

from pagedkv.storage.ssd.memory import direct_empty

MiB = 1024**2
CHUNK = 8 * MiB
COLD_AT_MOST = 0.01  # resident fraction of a file that still counts as a cold read

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(path: Path) -> float:
    """The share of the file's pages that are in the page cache now (mincore(2))."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0.0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap of {path} for mincore failed")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in bytes(vec)) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_cache(paths: list[Path]) -> None:
    """Evict these files from the page cache and check they are gone. The sync first:
    `POSIX_FADV_DONTNEED` drops clean pages only, and a block file written a moment
    ago by the store's writer may still be dirty."""
    os.sync()
    resident = 0.0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        resident = max(resident, resident_fraction(path))
    if resident > COLD_AT_MOST:
        raise RuntimeError(
            f"after dropping {len(paths)} files from the page cache, one still has "
            f"{resident:.0%} of its pages there, so a read of it would not measure the disk; "
            "is another process mapping it?"
        )


def buffered_read(path: Path) -> tuple[int, float]:
    buf = memoryview(bytearray(CHUNK))  # zero-filled: faulted in already
    total = 0
    with open(path, "rb", buffering=0) as f:
        start = time.perf_counter()
        while n := f.readinto(buf):
            total += n
    return total, time.perf_counter() - start


def direct_read(path: Path) -> tuple[int, float]:
    t, _ = direct_empty(CHUNK)
    # Faulted in before the clock starts; by memset, not a torch op, which would
    # leave an OpenMP team on this thread (see bench_ttft.py).
    ctypes.memset(t.data_ptr(), 0, CHUNK)
    buf = t.numpy().data
    total = 0
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        start = time.perf_counter()
        while n := os.preadv(fd, [buf], total):
            total += n
        return total, time.perf_counter() - start
    finally:
        os.close(fd)


def sequential_reads(path: Path) -> dict[str, float]:
    """Bytes/s of a cold buffered and a cold O_DIRECT read of the whole file."""
    rates = {}
    for how, read in (("buffered", buffered_read), ("O_DIRECT", direct_read)):
        drop_cache([path])
        nbytes, seconds = read(path)
        rates[how] = nbytes / seconds
    return rates


def write_probe(path: Path, num_bytes: int) -> Path:
    """A file of `num_bytes` random bytes, synced (so its pages can be dropped)."""
    chunk = os.urandom(CHUNK)
    with open(path, "wb") as f:
        for _ in range(max(1, num_bytes // CHUNK)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return path
