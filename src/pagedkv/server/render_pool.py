"""A few threads, shared by every route, for tokenizer and chat-template work.

Rendering a prompt runs Python (Jinja) and the tokenizer for as long as the
prompt is big: seconds for millions of characters. On anyio's default thread
pool (40 threads, shared with everything else the app runs off the event
loop) one key's burst of big prompts could take every thread. Here that work
has its own small pool, and it is submitted only after the key's share is
taken (`limits.KeyShare`), so one key holds at most its share of the pool's
queue. Rejected: an anyio `CapacityLimiter`, which binds to the event loop that
first uses it, while this pool must serve whichever loop runs the app.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

DEFAULT_RENDER_THREADS = 4

T = TypeVar("T")


class RenderPool:
    """`run` calls `fn(arg)` on one of `threads` threads and awaits its result; calls
    past that wait in FIFO order. A call not yet started is dropped if its awaiter is
    cancelled (the client went away)."""

    def __init__(self, threads: int = DEFAULT_RENDER_THREADS) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="pagedkv-render")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
