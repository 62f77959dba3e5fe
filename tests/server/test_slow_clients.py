"""Slow and stalled clients against the real uvicorn server (in a thread, over a fake
engine): each request must arrive within the receive deadline, and connections are capped.
Every test here ends by itself within a few seconds."""

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

from pagedkv.server.app import create_app
from pagedkv.server.serve import server_config

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
    yield from serve(receive_timeout=RECEIVE_TIMEOUT)


def open_slow(url: str, n: int, body: bool) -> list[socket.socket]:
    """`n` connections that start a request and then send one byte at a time: of a
    header (`body` False) or of a body whose Content-Length is never reached."""
    port = int(url.rsplit(":", 1)[1])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n"
    head += b"Content-Length: 100000\r\n\r\n" if body else b"X-Slow: "
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(head)
        s.setblocking(False)
        socks.append(s)
    return socks


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


def test_connections_past_the_cap_get_503_until_idle_ones_are_cut_off() -> None:
    for url in serve(receive_timeout=RECEIVE_TIMEOUT, max_connections=16):
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        time.sleep(0.2)  # accepted by the server
        assert httpx.get(url + "/health", timeout=5.0).status_code == 503
        time.sleep(RECEIVE_TIMEOUT + 0.5)  # the idle ones sent no request in time
        assert httpx.get(url + "/health", timeout=5.0).status_code == 200
        for s in idle:
            s.close()
