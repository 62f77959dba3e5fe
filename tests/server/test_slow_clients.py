"""Slow and stalled clients against the real uvicorn server (in a thread, over a fake
engine, then a `pagedkv serve` subprocess): each request's headers and body must arrive
within their deadlines, connections are capped overall and per client address, and
/health and /metrics answer while every connection is held. Loopback addresses other than
127.0.0.1 (all of 127.0.0.0/8 reaches the server on Linux) play other clients. Every
test here ends by itself within a few seconds."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from server_fake_engine import FakeEngine
from server_proc import ServerProc, running, small_context_model_dir, start_server

from pagedkv.server.app import create_app
from pagedkv.server.serve import server_config

__all__ = ["small_context_model_dir"]  # a fixture, used by name

RECEIVE_TIMEOUT = 1.0


def serve(**limits: Any) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    config = server_config(create_app(FakeEngine()), log_level="warning", **limits)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture
def url() -> Iterator[str]:
    # One address sends everything here: no per-client cap, to test the deadlines alone.
    yield from serve(receive_timeout=RECEIVE_TIMEOUT, max_connections_per_client=0)


def open_slow(url: str, n: int, body: bool, source: str = "127.0.0.1") -> list[socket.socket]:
    """`n` connections from `source` that start a request and then send one byte at a
    time: of a header (`body` False) or of a body whose Content-Length is never reached."""
    port = int(url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
    head += b"Content-Length: 100000\r\n\r\n" if body else b"X-Slow: "
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
        s.sendall(head)
        s.setblocking(False)
        socks.append(s)
    return socks


def is_open(s: socket.socket) -> bool:
    """Whether the server still holds `s` open and silent: it answers a half-sent request
    only to refuse it (a 503, then closed) or to close it."""
    try:
        readable, _, _ = select.select([s], [], [], 0)
    except OSError:
        return False
    return not readable


def settle(socks: list[socket.socket], seconds: float = 0.5) -> int:
    """Wait for the server to accept or refuse `socks`; how many it holds open."""
    time.sleep(seconds)
    return sum(is_open(s) for s in socks)


def trickle_until_closed(socks: list[socket.socket], limit_s: float) -> dict[int, float]:
    """Send a byte on every open socket every 0.1 s; when each was closed by the server."""
    started = time.monotonic()
    closed: dict[int, float] = {}
    while len(closed) < len(socks) and time.monotonic() - started < limit_s:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                readable, _, _ = select.select([s], [], [], 0)
                if readable and s.recv(4096) == b"":
                    raise ConnectionResetError
                s.send(b"x")
            except (ConnectionError, BlockingIOError, OSError):
                closed[i] = time.monotonic() - started
        time.sleep(0.1)
    for s in socks:
        s.close()
    return closed


def test_300_trickling_clients_are_cut_off_and_do_not_slow_health(url: str) -> None:
    latencies: list[float] = []
    statuses: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=5.0) as http:
            while not stop.is_set():
                started = time.perf_counter()
                statuses.append(http.get("/health").status_code)
                latencies.append(time.perf_counter() - started)
                time.sleep(0.05)

    slow = open_slow(url, 150, body=False) + open_slow(url, 150, body=True)
    prober = threading.Thread(target=probe)
    prober.start()
    try:
        closed = trickle_until_closed(slow, limit_s=RECEIVE_TIMEOUT + 4)
    finally:
        stop.set()
        prober.join()
    assert len(closed) == 300, f"{300 - len(closed)} trickling connections were never cut off"
    assert max(closed.values()) < RECEIVE_TIMEOUT + 2
    assert statuses and set(statuses) == {200}
    assert max(latencies) < 0.5, f"/health took {max(latencies):.2f} s at worst"


def test_a_whole_request_sent_in_time_is_served(url: str) -> None:
    with httpx.Client(base_url=url, timeout=5.0) as http:
        for _ in range(3):  # keep-alive: each request on the connection gets its own deadline
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200
            time.sleep(RECEIVE_TIMEOUT * 0.6)


def test_past_the_cap_the_api_gets_503_and_health_and_metrics_still_answer() -> None:
    limits = {"max_connections": 16, "max_connections_per_client": 0}
    for url in serve(receive_timeout=RECEIVE_TIMEOUT, **limits):
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        time.sleep(0.2)  # accepted by the server
        r = httpx.get(url + "/v1/models", timeout=5.0)
        assert r.status_code == 503 and "--max-connections" in r.json()["error"]["message"]
        assert httpx.get(url + "/health", timeout=5.0).status_code == 200
        assert httpx.get(url + "/metrics", timeout=5.0).status_code == 200
        time.sleep(RECEIVE_TIMEOUT + 0.5)  # the idle ones sent no request in time
        assert httpx.get(url + "/v1/models", timeout=5.0).status_code == 200
        for s in idle:
            s.close()


# -- a real `pagedkv serve` ------------------------------------------------------------

MAX_CONNECTIONS = 32  # so a quarter, 8, is the per-client cap


@pytest.fixture(scope="module")
def server(small_context_model_dir: Any) -> Iterator[ServerProc]:
    args = ["--max-connections", str(MAX_CONNECTIONS), "--receive-timeout", "4"]
    yield from running(start_server(small_context_model_dir, args=args))


@pytest.mark.slow
def test_health_answers_while_many_addresses_hold_every_connection(server: ServerProc) -> None:
    # 6 addresses x 8 connections (each address's cap), more than --max-connections: 16
    # trickle a body (opened first: a request whose headers arrive past the cap is
    # answered 503 at once), 32 their headers, as a flood from many clients would.
    slow: list[socket.socket] = []
    for k in range(6):
        slow += open_slow(server.url, 8, body=k < 2, source=f"127.0.0.{k + 2}")
        if k == 1:
            assert settle(slow, 0.3) == 16
    try:
        assert settle(slow, 0.3) == 48
        with httpx.Client(base_url=server.url, timeout=5.0) as http:
            for _ in range(3):
                started = time.perf_counter()
                r = http.get("/health")
                assert r.status_code == 200, r.text
                assert time.perf_counter() - started < 1.5
            assert http.get("/metrics").status_code == 200
            r = http.get("/v1/models")  # the cap itself still holds for the API
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
    finally:
        for s in slow:
            s.close()


@pytest.mark.slow
def test_one_address_cannot_take_every_connection(server: ServerProc) -> None:
    slow = open_slow(server.url, MAX_CONNECTIONS + 8, body=True, source="127.0.0.9")
    try:
        held = settle(slow)
        assert held == MAX_CONNECTIONS // 4, f"one address holds {held} connections"
        with httpx.Client(base_url=server.url, timeout=5.0) as http:
            assert http.get("/v1/models").status_code == 200
            assert http.get("/health").status_code == 200
    finally:
        for s in slow:
            s.close()


@pytest.mark.slow
def test_headers_get_a_shorter_deadline_than_the_body() -> None:
    for url in serve(receive_timeout=3.0, header_timeout=0.5, max_connections_per_client=0):
        headers = open_slow(url, 4, body=False)
        bodies = open_slow(url, 4, body=True)
        try:
            closed = trickle_until_closed(headers, limit_s=2.0)
            assert len(closed) == 4 and max(closed.values()) < 1.5, closed
            assert settle(bodies, 0.0) == 4  # a body still arriving keeps its longer deadline
            closed = trickle_until_closed(bodies, limit_s=4.0)
            assert len(closed) == 4 and min(closed.values()) > 1.0, closed
        finally:
            for s in headers + bodies:
                s.close()
