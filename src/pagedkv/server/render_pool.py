"""A few threads, shared by every route, for tokenizer and chat-template work.

Rendering a prompt runs Python (Jinja) and the tokenizer for as long as the
prompt is big: seconds for millions of characters. On anyio's default thread
pool (40 threads, shared with everything else the app runs off the event
loop) one key's burst of big prompts could take every thread. Here that work
has its own small pool, submitted only after the key's share is taken
(`limits.KeyShare`), and the pool is fair between keys: each key's calls wait
in a queue of its own, a free thread takes the next key's oldest call in turn,
and one key runs at most half the threads at once. So a key rendering huge
prompts slows its own requests, while another key's prompt finds a thread at
once (the hostile soak measured a normal key's latency 37x its quiet figure
when one key could hold every thread). Rejected: an anyio `CapacityLimiter`,
which binds to the event loop that first uses it, while this pool must serve
whichever loop runs the app.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

DEFAULT_RENDER_THREADS = 4

T = TypeVar("T")


@dataclass(slots=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple[object, ...]
    future: Future[Any]


class RenderPool:
    """`run(owner, fn, *args)` calls `fn(*args)` on one of `threads` threads and awaits
    its result. Calls wait in one FIFO queue per owner; a free thread serves the owners
    in turn (round robin over those with calls waiting), and an owner other than None
    runs at most `per_owner` calls at once (half the threads, at least one). Owner None,
    a server without keys, is one tenant and may use every thread. A call not yet
    started is dropped if its awaiter is cancelled (the client went away)."""

    def __init__(self, threads: int = DEFAULT_RENDER_THREADS) -> None:
        self.threads = threads
        self.per_owner = max(1, threads // 2)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="pagedkv-render")
        self._lock = threading.Lock()
        self._waiting: dict[str | None, deque[_Call]] = {}
        self._turns: deque[str | None] = deque()  # owners with calls waiting, in turn
        self._running: dict[str | None, int] = {}
        self._busy = 0

    async def run(self, owner: str | None, fn: Callable[..., T], *args: object) -> T:
        call = _Call(fn, args, Future())
        with self._lock:
            queue = self._waiting.setdefault(owner, deque())
            if not queue:
                self._turns.append(owner)
            queue.append(call)
            self._dispatch()
        result: T = await asyncio.wrap_future(call.future)
        return result

    def _dispatch(self) -> None:
        """Start waiting calls while threads are free (under the lock)."""
        skipped: list[str | None] = []
        while self._busy < self.threads and self._turns:
            owner = self._turns.popleft()
            if owner is not None and self._running.get(owner, 0) >= self.per_owner:
                skipped.append(owner)  # at its cap: its turn comes when one of its calls ends
                continue
            queue = self._waiting[owner]
            call = queue.popleft()
            if queue:
                self._turns.append(owner)
            else:
                del self._waiting[owner]
            if not call.future.set_running_or_notify_cancel():
                continue  # its awaiter went away before it started
            self._busy += 1
            self._running[owner] = self._running.get(owner, 0) + 1
            self._executor.submit(self._call, owner, call)
        self._turns.extendleft(reversed(skipped))

    def _call(self, owner: str | None, call: _Call) -> None:
        try:
            call.future.set_result(call.fn(*call.args))
        except BaseException as exc:
            call.future.set_exception(exc)
        finally:
            with self._lock:
                self._busy -= 1
                left = self._running[owner] - 1
                if left:
                    self._running[owner] = left
                else:
                    del self._running[owner]
                self._dispatch()

    def close(self) -> None:
        with self._lock:
            for queue in self._waiting.values():
                for call in queue:
                    call.future.cancel()
            self._waiting.clear()
            self._turns.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
