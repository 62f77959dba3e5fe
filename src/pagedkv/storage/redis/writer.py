"""The Redis tier's background writer: a byte-bounded queue drained by one thread."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from pagedkv.storage.base import KVBlock

log = logging.getLogger(__name__)

BATCH_BYTES = 16 * 1024**2  # per write pipeline: a lookup waits behind at most one


class WriteQueue:
    """Blocks waiting to be written, and the thread that writes them in batches.

    `put` never waits: a block that would take the queue past `limit_bytes` is
    dropped and counted by the caller. The thread first runs `on_start` (checks
    that may wait on the network), then hands batches of at most `BATCH_BYTES`
    (or one block) to `write`; an exception there drops that batch, counted
    through `on_dropped`, and the thread goes on. `flush` waits until the queue
    is empty and no batch is in flight.
    """

    def __init__(
        self,
        limit_bytes: int,
        write: Callable[[list[KVBlock]], None],
        on_start: Callable[[], None],
        on_dropped: Callable[[int], None],
    ) -> None:
        self._queue: deque[KVBlock] = deque()
        self._limit = limit_bytes
        self.queued_bytes = 0
        self._busy = False
        self.closing = False
        self._write = write
        self._on_start = on_start
        self._on_dropped = on_dropped
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="pagedkv-redis", daemon=True)
        self._thread.start()

    def put(self, blocks: Sequence[KVBlock]) -> int:
        """Queue `blocks`; returns how many did not fit."""
        dropped = 0
        with self._cond:
            for block in blocks:
                size = block.num_bytes
                if self.queued_bytes + size > self._limit:
                    dropped += 1
                    continue
                self._queue.append(block)
                self.queued_bytes += size
            self._cond.notify()
        return dropped

    def drop_namespace(self, namespace: str) -> None:
        with self._cond:
            dropped = [b for b in self._queue if b.meta.namespace == namespace]
            self._queue = deque(b for b in self._queue if b.meta.namespace != namespace)
            self.queued_bytes -= sum(b.num_bytes for b in dropped)

    def flush(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 2.0) -> int:
        """Stop the thread; returns the number of blocks left unwritten."""
        with self._cond:
            self.closing = True
            dropped = len(self._queue)
            self._queue.clear()
            self.queued_bytes = 0
            self._cond.notify_all()
        self._thread.join(timeout=timeout)
        return dropped

    def _loop(self) -> None:
        self._on_start()
        while True:
            with self._cond:
                while not self._queue and not self.closing:
                    self._cond.wait()
                if self.closing:
                    return
                batch: list[KVBlock] = []
                size = 0
                while self._queue and (not batch or size < BATCH_BYTES):
                    block = self._queue.popleft()
                    batch.append(block)
                    size += block.num_bytes
                self._busy = True
            try:
                self._write(batch)
            except Exception:  # the writer must outlive any bad block
                log.exception("Redis tier: writing %d block(s) failed", len(batch))
                self._on_dropped(len(batch))
            finally:
                with self._cond:
                    self.queued_bytes -= size
                    self._busy = False
                    self._cond.notify_all()
