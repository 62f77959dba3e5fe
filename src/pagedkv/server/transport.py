"""Connection-level limits under uvicorn: a deadline for receiving each request.

uvicorn caps connections (`limit_concurrency`: past it, requests get 503) and
closes idle keep-alive connections (`timeout_keep_alive`), but it has no
deadline for a request that is still arriving: a client can open a connection
and send its headers or body one byte at a time for ever (slowloris), holding
a connection slot and a buffer each. `deadline_protocol` adds that deadline to
uvicorn's own h11 protocol, without changing how it parses: a timer starts
when the connection opens and again after each response, and is stopped when
the request's last body byte has arrived; if it fires first, the connection is
closed (the app, if it had started, sees a disconnect). A long answer is not
affected: the deadline covers receiving the request, never generating.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

DEFAULT_RECEIVE_TIMEOUT_S = 30.0


def deadline_protocol(receive_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request has not fully arrived
    within `receive_timeout` seconds."""

    class DeadlineH11Protocol(H11Protocol):
        _receive_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete and not cycle.more_body:
                self._disarm()  # the request is in: the rest is the app's time

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own deadline

        def _arm(self) -> None:
            self._disarm()
            self._receive_timer = self.loop.call_later(receive_timeout, self._expired)

        def _disarm(self) -> None:
            if self._receive_timer is not None:
                self._receive_timer.cancel()
                self._receive_timer = None

        def _expired(self) -> None:
            self._receive_timer = None
            if not self.transport.is_closing():
                log.debug("closing %s: no whole request in %.0f s", self.client, receive_timeout)
                self.transport.close()

    return DeadlineH11Protocol
