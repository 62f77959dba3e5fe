"""Memory that block files are read into: huge-page backed, faulted in once, reused.

Two measured costs on this project's VM (2 cores, a virtio disk) shape it:

- Fresh pages are dear: faulting in a new 2.9 MiB block costs ~1.5 ms (the host
  backs guest memory lazily), five times the memcpy of the same bytes and more
  than its checksum, and an O_DIRECT read faults its pages before it sends the
  request, so the disk waits for it. `BlockMemory` therefore hands out buffers
  that a dead block gave back (its tensor's memoryview is watched with
  `weakref.finalize`), and keeps up to `keep_bytes` of them.
- An O_DIRECT request carries one segment per physically contiguous run of the
  buffer, and a virtio disk takes at most `max_segments` (254 here) per
  request, so 4 KiB pages split a 2.9 MiB block into three ~1 MiB requests. On
  huge pages it goes as one (`/proc/diskstats`: average request 1.1 -> 2.9
  MiB). The tail past the last whole huge page stays in 4 KiB pages, so at most
  a few KiB are wasted. Where transparent huge pages are off the advice is a
  no-op. A shared map (`mmap`'s default) would never get huge pages (shmem has
  its own switch, usually off), hence MAP_PRIVATE.

Rejected: glibc's heap (`torch.empty`), which gives 2.9 MiB chunks back to the
kernel on free, so each restore faults them in again (measured: the same 1.8
ms per block after a free as before); a per-thread landing buffer plus a
memcpy into fresh memory, which still pays the faults.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref

import torch

HUGE = 2 * 1024**2  # a transparent huge page on x86-64 and arm64 with 4K base pages


def direct_empty(size: int) -> tuple[torch.Tensor, mmap.mmap]:
    """An uninitialised uint8 tensor of `size` bytes on a 2 MiB boundary, in its own
    private anonymous map (returned too), its whole 2 MiB spans advised as huge pages."""
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    offset = -whole.data_ptr() % HUGE
    huge = size // HUGE * HUGE
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            m.madvise(mmap.MADV_HUGEPAGE, offset, huge)
    return whole[offset : offset + size], m


class BlockMemory:
    """A pool of faulted-in buffers keyed by size. Thread-safe.

    `take(size)` returns a uint8 tensor that owns its buffer until the tensor and
    every view of it are gone; then the buffer returns to the pool (or is
    unmapped when the pool already keeps `keep_bytes`). Contents are whatever the
    last user left: callers overwrite every byte they read.
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = int(keep_bytes)
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._kept_bytes = 0
        self.num_created = 0  # buffers ever mapped (a reuse rate is 1 - created / taken)
        self.num_taken = 0

    @property
    def kept_bytes(self) -> int:
        """Bytes of free buffers the pool holds now."""
        return self._kept_bytes

    def take(self, size: int) -> torch.Tensor:
        with self._lock:
            self.num_taken += 1
            free = self._free.get(size)
            m = free.pop() if free else None
            if m is not None:
                self._kept_bytes -= size
        if m is None:
            _, m = direct_empty(size)
            with self._lock:
                self.num_created += 1
        view = memoryview(m)
        whole = torch.frombuffer(view, dtype=torch.uint8)
        offset = -whole.data_ptr() % HUGE
        finalizer = weakref.finalize(view, self._give_back, size, m)
        finalizer.atexit = False
        return whole[offset : offset + size]

    def _give_back(self, size: int, m: mmap.mmap) -> None:
        with self._lock:
            if self._kept_bytes + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(m)
                self._kept_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._kept_bytes = 0
