"""How the SSD tier reads a restore's block files: in parallel, each handed over as it completes.

`BlockReader` runs one read function per block on its threads and yields each
result as its read completes, in completion order, so the caller copies block i
into place while the disk still serves the others (copy and I/O overlap)
instead of waiting for the whole batch.

Cold files (not in the page cache) are read one of two ways (`ssd_io`):
O_DIRECT, or buffered with the pages dropped after. Which is faster depends on
the disk and the virtual machine in front of it, and it changes between hosts,
so `ReadPathChooser` measures it on the restores themselves and keeps the
figures in `<directory>/read_path.json`, so a restart starts from the known
faster path. Until each path has `MIN_SAMPLES` measurements the two alternate;
after that the faster by median of the last `KEEP_SAMPLES` is used, and every
`RETRY_EVERY`-th measured restore goes the other way, so a change of disk
speed (a move to another host, a noisy neighbour that left) is noticed; the
count of measured restores is kept in the file too, or a server restarted
after every few restores would never reach a retry. Only a
batch of at least `MIN_SAMPLE_BYTES`, all of it cold, is a measurement: a
small batch is dominated by latency and a warm one by memcpy.

Rejected: `POSIX_FADV_WILLNEED` for every block of a restore at once before
the buffered reads. Measured on this project's 2-core VM (136 files of 2.9
MiB, 4-8 threads, interleaved runs), it was slower than plain parallel
buffered reads (550-900 against 750-1100 MiB/s) and than O_DIRECT, because
the advice is issued in 2 MiB requests from one thread ahead of the readers,
and a whole-file `preadv` already makes the kernel read ahead the whole file.
Rejected too: a choice measured once at start-up, which costs a cold read of
data a fresh directory does not have and is not repeated when the disk
changes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from pagedkv.errors import CacheCorruptionError
from pagedkv.storage.ssd.safefile import CREATE_FLAGS, load_json

log = logging.getLogger(__name__)

ReadPath = Literal["direct", "buffered"]
READ_PATHS: tuple[ReadPath, ...] = ("direct", "buffered")
CHOICE_NAME = "read_path.json"
MIN_SAMPLES = 3
KEEP_SAMPLES = 5
RETRY_EVERY = 16
MIN_SAMPLE_BYTES = 32 * 1024**2
MAX_CHOICE_BYTES = 64 * 1024  # what `record` writes is under 1 KiB
MAX_MIB_S = 1e9  # a PiB/s: any figure above is not a measurement

J = TypeVar("J")
R = TypeVar("R")


class ReadPathChooser:
    """Picks the read path of each batch and learns from its measured throughput.

    Thread-safe. `fixed` pins one path (no measuring, nothing written). The
    choice file is advisory: unreadable or malformed (any bytes, a link, a
    FIFO, a huge file: `ssd_safefile`), it is ignored with a warning, measured
    again and rewritten; unwritable, the figures live in memory only.
    """

    def __init__(self, directory: Path | None, fixed: ReadPath | None = None) -> None:
        self.fixed = fixed
        self._file = None if directory is None else directory / CHOICE_NAME
        self._lock = threading.Lock()
        self._samples: dict[ReadPath, list[float]] = {p: [] for p in READ_PATHS}
        self._measured = 0
        self._write_warned = False
        self._load()

    @property
    def path(self) -> ReadPath:
        """The path a batch takes when no retry of the other one is due."""
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            return self._best()

    def samples(self) -> dict[ReadPath, list[float]]:
        """The kept measurements, MiB/s, oldest first."""
        with self._lock:
            return {p: list(v) for p, v in self._samples.items()}

    def pick(self) -> ReadPath:
        if self.fixed is not None:
            return self.fixed
        with self._lock:
            short = [p for p in READ_PATHS if len(self._samples[p]) < MIN_SAMPLES]
            if short:
                return min(short, key=lambda p: len(self._samples[p]))
            best = self._best()
            if self._measured % RETRY_EVERY == RETRY_EVERY - 1:
                return "buffered" if best == "direct" else "direct"
            return best

    def record(self, path: ReadPath, nbytes: int, seconds: float) -> None:
        """One batch's cold reads: `nbytes` in `seconds` on `path`."""
        if self.fixed is not None or nbytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        with self._lock:
            kept = self._samples[path]
            kept.append(nbytes / seconds / 1024**2)
            del kept[:-KEEP_SAMPLES]
            self._measured += 1
            state = {
                "version": 1,
                "path": self._best(),
                "mib_s": self._samples,
                "measured": self._measured,
            }
            text = json.dumps(state, indent=1)
        self._save(text)

    def _best(self) -> ReadPath:
        ready = {p: v for p, v in self._samples.items() if len(v) >= MIN_SAMPLES}
        if len(ready) < len(READ_PATHS):
            return "direct"  # no page-cache copy: the cheaper on a busy CPU
        return max(READ_PATHS, key=lambda p: statistics.median(ready[p]))

    def _load(self) -> None:
        if self._file is None or self.fixed is not None:
            return
        try:
            state = _parse_state(load_json(self._file, MAX_CHOICE_BYTES))
        except FileNotFoundError:
            return
        except (OSError, CacheCorruptionError) as exc:
            log.warning("ignoring the SSD read-path figures: %s; measuring again", exc)
            return
        if state is None:
            log.warning(
                "ignoring the SSD read-path figures in %s: not the figures pagedkv writes; "
                "measuring again",
                self._file,
            )
            return
        self._samples, self._measured = state

    def _save(self, text: str) -> None:
        if self._file is None:
            return
        # A random name, created exclusively: a file or link already there (planted, or
        # left by a crash) is never truncated or written through.
        tmp = self._file.with_name(f"{CHOICE_NAME}.tmp-{os.urandom(6).hex()}")
        try:
            fd = os.open(tmp, CREATE_FLAGS, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self._file)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if not self._write_warned:
                self._write_warned = True
                log.info("SSD read-path figures not kept in %s (%s)", self._file, exc)


def _parse_state(state: object) -> tuple[dict[ReadPath, list[float]], int] | None:
    """The kept figures and the measured count from a decoded choice file, or None when
    any part is not what `record` writes (a type, a range, a missing key)."""
    if not isinstance(state, dict) or not isinstance(state.get("mib_s"), dict):
        return None
    samples: dict[ReadPath, list[float]] = {}
    for p in READ_PATHS:
        values = state["mib_s"].get(p, [])
        if not isinstance(values, list) or not all(
            type(x) in (int, float) and 0 < x < MAX_MIB_S for x in values
        ):
            return None
        samples[p] = [float(x) for x in values[-KEEP_SAMPLES:]]
    measured = state.get("measured", 0)
    if type(measured) is not int or not 0 <= measured < 2**62:
        return None
    return samples, measured


@dataclass(slots=True)
class ReadBatch:
    """One batch's reads: the path they take and the cold bytes they read."""

    path: ReadPath
    started: float = field(default_factory=time.perf_counter)
    cold_bytes: int = 0
    warm_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def direct(self) -> bool:
        return self.path == "direct"

    def count(self, nbytes: int, cold: bool) -> None:
        with self._lock:
            if cold:
                self.cold_bytes += nbytes
            else:
                self.warm_bytes += nbytes


class BlockReader:
    """A pool of read threads that hands back results as they complete.

    `threads` is how many files are read at once: enough requests in flight to
    keep a virtual disk busy between one request's completion and the next
    submission. Threads start lazily, up to that size.
    """

    def __init__(self, threads: int, chooser: ReadPathChooser) -> None:
        self.threads = max(1, int(threads))
        self.chooser = chooser
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pagedkv-ssd-read")

    @property
    def path(self) -> ReadPath:
        return self.chooser.path

    def begin(self) -> ReadBatch:
        return ReadBatch(self.chooser.pick())

    def end(self, batch: ReadBatch) -> None:
        if batch.warm_bytes == 0:
            batch_s = time.perf_counter() - batch.started
            self.chooser.record(batch.path, batch.cold_bytes, batch_s)

    def completed(self, fn: Callable[[J], R], jobs: Sequence[J]) -> Iterator[tuple[int, R]]:
        """`(k, fn(jobs[k]))` for every job, in the order the calls finish. One job runs
        on the calling thread. An exception of `fn` propagates once the others finish."""
        if len(jobs) == 1:
            yield 0, fn(jobs[0])
            return
        futures: dict[Future[R], int] = {
            self._pool.submit(fn, job): k for k, job in enumerate(jobs)
        }
        error: BaseException | None = None
        for future in as_completed(futures):  # one waiter for all, not one per wait
            exc = future.exception()
            if exc is not None:
                error = error or exc
            elif error is None:
                yield futures[future], future.result()
        if error is not None:
            raise error

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
