"""Run the app under uvicorn, with a shutdown that finishes or cancels work and flushes the cache.

Shutdown on SIGTERM or SIGINT, in order: stop accepting connections and
answer new requests on open ones with 503; give in-flight requests
`drain_timeout` seconds to finish, then cancel the rest (a stream ends with an
error event and `[DONE]`, its blocks are released); then `engine.close()`
flushes queued cache writes within `close_timeout`. The defaults keep the whole
sequence under 20 s, the usual grace period before a SIGKILL. A second SIGINT
skips the waiting.

Connections (`server/transport.py`): requests arriving while more than
`max_connections` are open get 503, except /health and /metrics, which answer
whatever the count; one client address may hold `max_connections_per_client`;
a request's headers must arrive within `header_timeout` seconds and the whole
request within `receive_timeout`, so slow or stalled clients can neither hold
the server's connections nor make its health check fail.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType

import uvicorn

from pagedkv.engine.stats import EngineStats
from pagedkv.server.app import DEFAULT_MAX_BODY_BYTES, ServerState, create_app
from pagedkv.server.engine_api import EngineAPI
from pagedkv.server.error_handlers import error_body
from pagedkv.server.images import ImageLimits
from pagedkv.server.limits import RequestLimits
from pagedkv.server.transport import (
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_RECEIVE_TIMEOUT_S,
    ConnectionGuard,
)
from pagedkv.startup import bind_port

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 1024


def run_server(
    engine: EngineAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_keys: Iterable[str] = (),
    admin_keys: Iterable[str] | None = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    limits: RequestLimits | None = None,
    max_requests_per_key: int | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_client: int | None = None,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT_S,
    metrics_keys: Iterable[str] = (),
    keys_on_command_line: bool = False,
    model_name: str | None = None,
    tool_call_parser: str | None = None,
    served_model_names: Sequence[str] = (),
    images: ImageLimits | None = None,
    log_level: str = "info",
    access_log: bool = False,
    drain_timeout: float = 5.0,
    close_timeout: float = 10.0,
    sock: socket.socket | None = None,
) -> int:
    """Serve `engine` until SIGTERM/SIGINT, then close it; returns the exit status: 0, or
    1 when the engine's worker died (its requests have failed; a supervisor should
    restart the server).

    `port=0` picks a free port; the URL is logged either way. `sock`, a socket
    `bind_port` bound before the model was loaded, is served instead of binding
    `host:port`. The engine is closed on return, also when the server fails to start.
    Each request logs one line (`server/request_log.py`); `access_log` adds
    uvicorn's own access line, which says less and would repeat it. `keys_on_command_line`
    (the CLI sets it) logs a warning: other users of the host can read them in `ps`.
    `max_connections_per_client` None is a quarter of `max_connections`; 0 is no cap.
    `metrics_keys` may read /metrics (as may admin keys; see `server/authn.py`).
    `images` bounds requests' images (`server/images/`; default: `ImageLimits()`).
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    log.setLevel(log_level.upper())
    died = False
    try:
        app = create_app(
            engine,
            api_keys=api_keys,
            admin_keys=admin_keys,
            max_body_bytes=max_body_bytes,
            limits=limits,
            max_requests_per_key=max_requests_per_key,
            model_name=model_name,
            tool_call_parser=tool_call_parser,
            metrics_keys=metrics_keys,
            served_model_names=served_model_names,
            images=images,
        )
        state: ServerState = app.state.pagedkv
        sock = _listen(sock if sock is not None else bind_port(host, port))
        url = f"http://{_url_host(host)}:{sock.getsockname()[1]}"
        config = server_config(
            app,
            log_level=log_level,
            access_log=access_log,
            max_connections=max_connections,
            max_connections_per_client=max_connections_per_client,
            header_timeout=header_timeout,
            receive_timeout=receive_timeout,
            drain_timeout=drain_timeout,
        )
        server = _Server(config, state, drain_timeout, engine)
        num_metrics_keys = len({k for k in metrics_keys if k})
        _log_startup(engine, state, url, keys_on_command_line, num_metrics_keys, served_model_names)
        server.run(sockets=[sock])
        died = server.engine_died
    finally:
        started = time.monotonic()
        log.info("closing the engine (flushing cache writes, up to %.0f s)", close_timeout)
        engine.close(timeout=close_timeout)
        log.info("engine closed in %.1f s", time.monotonic() - started)
    return 1 if died else 0


def server_config(
    app: object,
    *,
    log_level: str = "info",
    access_log: bool = False,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_connections_per_client: int | None = None,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S,
    receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT_S,
    drain_timeout: float = 5.0,
) -> uvicorn.Config:
    """uvicorn's configuration for `app`, with pagedkv's connection limits (uvicorn's own
    `limit_concurrency` is off: it refused /health too; see `server/transport.py`)."""
    if max_connections_per_client is None:
        max_connections_per_client = default_per_client_cap(max_connections)
    guard = ConnectionGuard(
        max_connections=max_connections,
        max_per_client=max_connections_per_client,
        header_timeout=header_timeout,
        receive_timeout=receive_timeout,
    )
    return uvicorn.Config(
        guard.wrap(app, error_body),  # type: ignore[arg-type]
        http=guard.protocol(),
        limit_concurrency=None,
        log_level=log_level,
        access_log=access_log,
        lifespan="off",
        timeout_graceful_shutdown=int(drain_timeout) + 2,
    )


def default_per_client_cap(max_connections: int) -> int:
    """A quarter of the connections: it takes four addresses to fill the server, while
    one busy client (an application server calling in parallel) still gets hundreds."""
    return max(1, max_connections // 4)


def load_api_keys(path: str | Path) -> list[str]:
    """Keys from a file, one per line; blank lines and lines starting with '#' are skipped."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise OSError(exc.errno, f"cannot read the API keys file {path}: {exc.strerror}") from exc
    if path.stat().st_mode & 0o077:
        log.warning("the API keys file %s is readable by other users; chmod 600 it", path)
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"the API keys file {path} holds no keys (one key per line)")
    return keys


class _Server(uvicorn.Server):
    """uvicorn's server with pagedkv's drain-then-cancel shutdown.

    uvicorn re-raises the captured signal once it has shut down, which would
    kill the process before the engine is closed and turn a clean exit into
    "terminated by SIGTERM"; `handle_exit` therefore does not record it.
    """

    def __init__(
        self, config: uvicorn.Config, state: ServerState, drain_timeout: float, engine: EngineAPI
    ) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.engine = engine
        self.engine_died = False

    async def on_tick(self, counter: int) -> bool:
        if not self.engine_died and not self.engine.healthy:
            log.critical("the engine's worker died; exiting with status 1 so a supervisor restarts")
            self.engine_died = True
            self.state.closing = True
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.closing = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.closing = True
        n = len(self.state.generations)
        log.info("shutting down: %d requests in flight get %.0f s to finish", n, self.drain_timeout)
        canceller = asyncio.create_task(self._cancel_after(self.drain_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            canceller.cancel()

    async def _cancel_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        n = self.state.cancel_all()
        if n:
            log.warning("cancelled %d requests still running after %.0f s", n, delay)


def _listen(sock: socket.socket) -> socket.socket:
    try:
        # connect()s made from now on wait in the backlog until uvicorn accepts
        sock.listen(2048)
    except OSError as exc:  # another process bound the port too, and listened first
        host, port = sock.getsockname()[:2]
        raise OSError(
            exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port"
        ) from exc
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _log_startup(
    engine: EngineAPI,
    state: ServerState,
    url: str,
    keys_on_command_line: bool,
    num_metrics_keys: int = 0,
    served_model_names: Sequence[str] = (),
) -> None:
    # Every name a request may give as `model`, the id clients see first (`served_names`).
    names = list(dict.fromkeys([*served_model_names, state.model_name, engine.model_name]))
    log.info(
        "model %s (context %d tokens); requests may name it %s",
        engine.model_name,
        engine.max_context,
        ", ".join(names),
    )
    for adapter in engine.describe_adapters():
        log.info(
            "LoRA adapter %s (rank %d, digest %s) from %s; requests may name it %s or %s:%s",
            adapter["name"],
            adapter["rank"],
            adapter["digest"],
            adapter["path"],
            adapter["name"],
            names[0],
            adapter["name"],
        )
    stats = engine.cache_stats()
    for line in _cache_lines(stats):
        log.info("cache: %s", line)
    if stats.cache is not None and not any(t != "ram" for t in stats.cache.tiers):
        log.info("cache: RAM only, nothing is kept on disk; it is lost when the server stops")
    if keys_on_command_line:
        log.warning(
            "API keys were given on the command line, where any user of this host can "
            "read them (ps, /proc/<pid>/cmdline); pass them in PAGEDKV_API_KEY / "
            "PAGEDKV_ADMIN_KEY or in a file (--api-keys-file, --admin-keys-file) instead"
        )
    if state.keys.enabled:
        log.info(
            "API keys: %d (%d admin keys may clear the cache and see global statistics)",
            state.keys.num_keys,
            state.keys.num_admins,
        )
        if state.share.limit is not None:
            log.info("each key may have %d requests running at once", state.share.limit)
        if num_metrics_keys or state.keys.num_admins:
            log.info("/metrics needs a metrics key (%d) or an admin key", num_metrics_keys)
        else:
            log.warning(
                "/metrics answers no one: with API keys it needs a metrics key "
                "(--metrics-key, PAGEDKV_METRICS_KEY) or an admin key"
            )
    else:
        log.info("no API keys: anyone who can reach %s can use the server", url)
    auth = " -H 'Authorization: Bearer <your key>'" if state.keys.enabled else ""
    log.info("serving on %s", url)
    log.info(
        "try: curl %s/v1/chat/completions -H 'Content-Type: application/json'%s -d "
        '\'{"model": "%s", "messages": [{"role": "user", "content": "Hello!"}]}\'',
        url,
        auth,
        state.model_name,
    )


def _cache_lines(stats: EngineStats) -> list[str]:
    if stats.cache is None:
        return [f"prefix caching is off: {stats.caching_off_reason}"]
    lines = [f"block pool of up to {stats.cache.pool.max_blocks} blocks"]
    for name, tier in stats.cache.tiers.items():
        where = f" at {tier.location}" if tier.location else ""
        used, size = _gib(tier.bytes_used), _gib(tier.capacity_bytes)
        lines.append(f"tier {name}: {used} used of {size}{where}")
    return lines


def _gib(value: int) -> str:
    return f"{value / 1024**3:.2f} GiB" if value >= 1024**3 else f"{value / 1024**2:.1f} MiB"
