"""Iterating a blocking engine stream on its own thread, for the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from pagedkv.engine.request import StreamEvent

log = logging.getLogger(__name__)

_END = object()


class EventPump:
    """Iterates a blocking engine stream on its own thread, handing events to the loop.

    The engine's iterator is a generator: only the thread iterating it may
    close it (closing it from another thread while it waits for a token raises
    "generator already executing"). So `cancel()` only raises a flag, and the
    pump thread closes the iterator, which cancels the request and releases
    its blocks, as soon as the next event arrives: at most one decode step
    later. Rejected: one `to_thread` hop per token, which costs a thread-pool
    round trip per token and still cannot interrupt a waiting `next()`.
    """

    def __init__(self, open_stream: Callable[[], Iterator[StreamEvent]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._ended = False
        self._events: Iterator[StreamEvent] | None = None
        self._thread = threading.Thread(
            target=self._run, args=(open_stream,), name="pagedkv-stream", daemon=True
        )
        self._thread.start()

    def _run(self, open_stream: Callable[[], Iterator[StreamEvent]]) -> None:
        events: Iterator[StreamEvent] | None = None
        try:
            events = self._events = open_stream()
            if self._cancelled.is_set():
                return
            for event in events:  # ends after the last sample's finished event
                self._put(event)
                if self._cancelled.is_set():
                    break
        except BaseException as exc:  # handed to the request handler
            self._put(exc)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    log.exception("closing an engine stream failed")
            self._put(_END)

    def _put(self, item: object) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def next(self) -> StreamEvent | None:
        """The next event; None once the stream has ended. Re-raises engine errors."""
        if self._ended:
            return None
        item = await self._queue.get()
        if item is _END:
            self._ended = True
            return None
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, StreamEvent)
        return item

    def cancel(self) -> None:
        self._cancelled.set()
        # An engine iterator may offer a thread-safe `cancel()` that also reaches a request
        # still waiting in the queue; plain generators are closed by the pump thread.
        cancel = getattr(self._events, "cancel", None)
        if callable(cancel):
            cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
