"""One log line per request, written when the request ends.

`RequestIdMiddleware` (`server/middleware.py`) opens a `RequestRecord` for every
HTTP request and puts it in `REQUEST_RECORD` for the request's task; the parts
of the server that know something about the request fill it in: the error paths
its refusal (`note_error`), a generation its tokens and timings
(`server/generation.py`). When the response has been sent, the middleware
writes the line on the `pagedkv.requests` logger:

    req_5f0c... key=key1 client=127.0.0.1:50312 "POST /v1/chat/completions" 200
    prompt_tokens=38 cached_ram=32 cached_ssd=0 cached_redis=0 generated_tokens=16
    ttft_ms=41.2 total_ms=310.8 finish=stop

(one line). A refused request has `reason="..."` instead of the token fields. The
line replaces uvicorn's access line (which `run_server` turns off): both would
say the same method, path and status twice. Levels: INFO; WARNING for a 5xx;
DEBUG for a successful /health, /metrics or /v1/dashboard/state, which orchestrators,
scrapers and the dashboard page poll.

The key label never shows the key: `keyN` is the Nth API key the server was
given, `adminN` the Nth admin key (`server/auth.py`), `-` without keys or before
a key was accepted (a 401 names no key, not even the presented one's label).
Text a client chose (the path, a reason quoting a model name) is JSON-quoted, so
a newline or quote in it cannot forge a log line.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

log = logging.getLogger("pagedkv.requests")

REQUEST_RECORD: ContextVar[RequestRecord | None] = ContextVar(
    "pagedkv_request_record", default=None
)

TIERS = ("ram", "ssd", "redis")
MAX_REASON_CHARS = 300
# Polled: /health by orchestrators, /metrics by scrapers, the dashboard's data by its page.
QUIET_PATHS = frozenset({"/health", "/metrics", "/v1/dashboard/state"})


@dataclass(slots=True)
class Tokens:
    """What the engine did for a generation request (every sample together)."""

    prompt_tokens: int | None = None  # None: the request ended before the engine said
    cached: dict[str, int] = field(default_factory=dict)  # tier -> prompt tokens from it
    generated_tokens: int = 0
    ttft_s: float | None = None  # from arrival at the server to the first token
    finish: str = "-"  # each sample's finish reason, comma-separated; or how it ended


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    method: str
    path: str
    client: str
    started: float = field(default_factory=time.perf_counter)
    status: int = 0
    key_label: str = "-"
    reason: str | None = None
    tokens: Tokens | None = None


def note_error(message: str) -> None:
    """Record why the request being served is refused (the text its client reads)."""
    record = REQUEST_RECORD.get()
    if record is not None and record.reason is None:
        record.reason = message


def current_record() -> RequestRecord | None:
    return REQUEST_RECORD.get()


def log_request(record: RequestRecord) -> None:
    status = record.status
    if status >= 500:
        level = logging.WARNING
    elif status < 400 and record.path in QUIET_PATHS:
        level = logging.DEBUG
    else:
        level = logging.INFO
    if log.isEnabledFor(level):
        log.log(level, "%s", format_line(record, time.perf_counter()))


def format_line(record: RequestRecord, now: float) -> str:
    route = json.dumps(f"{record.method} {record.path}", ensure_ascii=True)
    parts = [
        record.request_id,
        f"key={record.key_label}",
        f"client={record.client}",
        route,
        str(record.status or "-"),
    ]
    t = record.tokens
    if t is not None:
        parts.append(f"prompt_tokens={'-' if t.prompt_tokens is None else t.prompt_tokens}")
        tiers = [*TIERS, *sorted(set(t.cached) - set(TIERS))]
        parts += [f"cached_{tier}={t.cached.get(tier, 0)}" for tier in tiers]
        parts.append(f"generated_tokens={t.generated_tokens}")
        parts.append(f"ttft_ms={'-' if t.ttft_s is None else f'{t.ttft_s * 1000:.1f}'}")
    parts.append(f"total_ms={(now - record.started) * 1000:.1f}")
    if t is not None:
        parts.append(f"finish={t.finish}")
    if record.reason is not None:
        reason = record.reason
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[:MAX_REASON_CHARS] + "..."
        parts.append("reason=" + json.dumps(reason, ensure_ascii=True))
    return " ".join(parts)
