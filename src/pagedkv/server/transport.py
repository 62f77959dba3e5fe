"""Connection-level limits under uvicorn: deadlines for receiving a request, a cap on one
client address's connections, and a connection cap that never refuses /health or /metrics.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but has no
deadline for a request that is still arriving: a client can open a connection
and send its headers or body one byte at a time for ever (slowloris), holding a
connection and a buffer each. Its own cap (`limit_concurrency`) answers 503 to
every request once that many connections are open, /health included, so a
client without a key that holds every connection with half-sent requests made
an orchestrator restart the server (and lose the RAM tier). `ConnectionGuard`
replaces that cap:

- **Deadlines.** A connection's request headers must be complete within
  `header_timeout` of the connection opening (or of the previous response), the
  whole request, body included, within `receive_timeout`; otherwise the
  connection is closed (the app, if it had started, sees a disconnect). Headers
  get the shorter deadline because nothing legitimate trickles them; a large
  body on a slow link may take longer. A connection opened while the server is
  over `max_connections` gets `OVERFLOW_HEADER_TIMEOUT_S` for its headers: a
  probe sends them at once, a flood must keep reconnecting. Generation time is
  never limited: the deadline stops when the request's last byte has arrived.
- **Per-client cap.** A client address with `max_per_client` connections open
  gets its next one answered with 503 and closed before a byte is read, so one
  address cannot hold every connection. 0 turns it off (behind a proxy, every
  client has the proxy's address: let the proxy bound its clients instead).
- **The cap.** Requests arriving while more than `max_connections` are open
  get 503, except `ALWAYS_SERVED` paths: the health check and the metrics
  answer whatever the count, so held connections cannot make a healthy server
  look dead. The rejected alternative, a reserved slot counted at accept,
  cannot work: a connection's path is unknown until its headers are in, which
  is exactly what a slowloris never sends.

Many addresses together can still open connections until the process's
open-file limit (`ulimit -n`); each is closed by its deadline, and keeping that
limit well above `--max-connections` keeps /health answering.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv.server.http_errors import APIError
from pagedkv.server.middleware import ErrorBody, openai_body, send_error

log = logging.getLogger(__name__)

DEFAULT_RECEIVE_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
OVERFLOW_HEADER_TIMEOUT_S = 2.0
ALWAYS_SERVED = frozenset({"/health", "/metrics"})


@dataclass
class ConnectionGuard:
    """The limits and the open-connection counts of one server.

    Invariant: `num_open` and `per_client` count the connections admitted by
    `admit` and not yet `release`d; a connection refused at accept is in neither.
    `max_per_client` 0 means no per-client cap.
    """

    max_connections: int
    max_per_client: int = 0
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT_S
    num_open: int = 0
    per_client: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        # A header deadline past the whole request's would never fire.
        self.header_timeout = min(self.header_timeout, self.receive_timeout)

    def admit(self, host: str) -> bool:
        """Count a new connection from `host`; False (and not counted) past its cap."""
        if self.max_per_client and self.per_client[host] >= self.max_per_client:
            return False
        self.num_open += 1
        self.per_client[host] += 1
        return True

    def release(self, host: str) -> None:
        self.num_open -= 1
        self.per_client[host] -= 1
        if self.per_client[host] <= 0:
            del self.per_client[host]

    @property
    def over_cap(self) -> bool:
        return self.num_open > self.max_connections

    def wrap(self, app: ASGIApp, error_body: ErrorBody = openai_body) -> ASGIApp:
        """`app`, answering 503 to requests past the cap except on `ALWAYS_SERVED` paths."""

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and self.over_cap and scope["path"] not in ALWAYS_SERVED:
                error = APIError(
                    503,
                    f"the server has {self.num_open} connections open, more than its limit of "
                    f"{self.max_connections} (--max-connections); retry shortly",
                    code="too_many_connections",
                    headers={"Retry-After": "1"},
                )
                await send_error(send, error_body(scope["path"], error), error)
                return
            await app(scope, receive, send)

        return guarded

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's h11 protocol, enforcing this guard's deadlines and per-client cap."""
        return _guarded_protocol(self)


def _refusal(guard: ConnectionGuard) -> bytes:
    body = json.dumps(
        APIError(
            503,
            f"this address has {guard.max_per_client} connections open, the most one client "
            "may (--max-connections-per-client); close some or retry shortly",
            code="too_many_connections",
        ).body()
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def _guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    class GuardedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _started: float = 0.0
        _host: str | None = None  # set once the connection is counted
        _headers_in: bool = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else ""
            if not guard.admit(host):
                log.debug("refusing %s: %d connections open from it", host, guard.max_per_client)
                transport.write(_refusal(guard))
                transport.close()
                return
            self._host = host
            overflow = guard.over_cap
            self._arm(min(guard.header_timeout, OVERFLOW_HEADER_TIMEOUT_S) if overflow else None)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._host is not None:
                guard.release(self._host)
                self._host = None
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if cycle is None or cycle.response_complete or self._timer is None:
                return
            if not cycle.more_body:
                self._disarm()  # the request is in: the rest is the app's time
            elif not self._headers_in:
                self._headers_in = True  # the body gets what is left of the whole deadline
                left = self._started + guard.receive_timeout - self.loop.time()
                self._disarm()
                self._timer = self.loop.call_later(max(0.0, left), self._expired)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own deadlines

        def _arm(self, header_timeout: float | None = None) -> None:
            self._disarm()
            self._headers_in = False
            self._started = self.loop.time()
            timeout = guard.header_timeout if header_timeout is None else header_timeout
            self._timer = self.loop.call_later(timeout, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                part = "body" if self._headers_in else "headers"
                log.debug("closing %s: the request's %s did not arrive in time", self.client, part)
                self.transport.close()

    return GuardedH11Protocol
