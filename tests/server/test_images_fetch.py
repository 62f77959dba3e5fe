"""server/images/fetch.py against a real HTTP server on 127.0.0.1: size, redirect and
time caps, and the public-address check (loopback is allowed only where a test
replaces the check, so the same server can stand in for a public one)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from image_engine import ImageEngine, image_parts_of
from image_files import encode, pixels

from pagedkv.model.images import image_from_pixels
from pagedkv.server.http_errors import APIError
from pagedkv.server.images import fetch
from pagedkv.server.images.fetch import fetch_image, public_address
from pagedkv.server.images.limits import ImageLimits

PNG = encode(pixels(), "PNG")
PARAM = "messages[0].content[0].image_url.url"
LIMITS = ImageLimits(allow_remote=True, max_bytes=4096, remote_timeout_s=1.0)


class Handler(BaseHTTPRequestHandler):
    hosts: list[str] = []  # noqa: RUF012  the Host header of each request, in order

    def log_message(self, *args: Any) -> None:
        pass

    def send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        Handler.hosts.append(self.headers.get("Host", ""))
        path = self.path
        if path == "/cat.png":
            self.send(200, PNG, Content_Type="image/png", Content_Length=str(len(PNG)))
        elif path == "/endless":  # no length: read until the connection closes
            self.send(200)
            for _ in range(64):
                self.wfile.write(b"\x89" * 1024)
        elif path == "/declared-big":
            self.send(200, b"x", Content_Length="99999999")
        elif path.startswith("/hop/"):
            left = int(path.rsplit("/", 1)[1])
            self.send(302, Location="/cat.png" if left == 0 else f"/hop/{left - 1}")
        elif path == "/to-private":
            self.send(302, Location="http://10.1.2.3/cat.png")
        elif path == "/to-file":
            self.send(302, Location="file:///etc/passwd")
        elif path == "/slow":
            time.sleep(3)
            self.send(200, PNG)
        elif path == "/trickle":  # each byte well within a read timeout, the whole not
            self.send(200)
            for _ in range(30):
                time.sleep(0.1)
                self.wfile.write(b"\x89")
                self.wfile.flush()
        elif path == "/gzip":
            self.send(200, b"\x1f\x8b", Content_Encoding="gzip", Content_Length="2")
        else:
            self.send(404, b"no")


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def loopback_is_public(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only 127.0.0.1 passes the address check: the test server stands in for a public
    host, and every other address (10.1.2.3 included) is still refused."""
    monkeypatch.setattr(fetch, "public_address", lambda ip: ip == "127.0.0.1")


def get(url: str, limits: ImageLimits = LIMITS) -> bytes:
    return asyncio.run(fetch_image(url, limits, PARAM))


def refused(url: str, limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(APIError) as caught:
        get(url, limits)
    assert caught.value.status == 400 and caught.value.param == PARAM
    return caught.value.message


@pytest.mark.parametrize(
    "ip",
    [
        "127.0.0.1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254",
        "100.64.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "192.0.2.1",
        "::1", "::", "fe80::1", "fc00::1", "fec0::1", "ff02::1",
        "::ffff:127.0.0.1", "2002:7f00:1::1", "2001:db8::1",
    ],
)  # fmt: skip
def test_private_and_special_addresses_are_not_public(ip: str) -> None:
    assert not public_address(ip)


@pytest.mark.parametrize("ip", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2002:808:808::1"])
def test_public_addresses_are_public(ip: str) -> None:
    assert public_address(ip)


def test_loopback_and_private_hosts_are_refused_without_a_connection(origin: str) -> None:
    before = len(Handler.hosts)
    assert "not a public address" in refused(origin + "/cat.png")
    port = origin.rsplit(":", 1)[1]
    assert "not a public address" in refused(f"http://localhost:{port}/cat.png")
    assert "not a public address" in refused("http://[::1]/cat.png")
    assert len(Handler.hosts) == before  # the server never saw a request


def test_an_image_is_fetched_from_the_checked_address_with_its_host_kept(
    origin: str, loopback_is_public: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert get(origin + "/cat.png") == PNG
    port = origin.rsplit(":", 1)[1]

    async def resolve(host: str, port: int) -> list[str]:
        assert host == "images.example"
        return ["127.0.0.1"]

    monkeypatch.setattr(fetch, "resolve_host", resolve)
    assert get(f"http://images.example:{port}/cat.png") == PNG
    assert Handler.hosts[-1] == f"images.example:{port}"


def test_a_host_resolving_to_any_private_address_is_refused(
    origin: str, loopback_is_public: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1", "10.0.0.7"]

    monkeypatch.setattr(fetch, "resolve_host", resolve)
    assert "resolves to 10.0.0.7" in refused("http://images.example/cat.png")


def test_size_caps(origin: str, loopback_is_public: None) -> None:
    assert "over this server's 4096 bytes" in refused(origin + "/endless")
    assert "over this server's 4096 bytes" in refused(origin + "/declared-big")
    assert "compressed ('gzip')" in refused(origin + "/gzip")
    assert "HTTP 404" in refused(origin + "/missing")


def test_redirects_are_followed_up_to_the_cap_each_checked(
    origin: str, loopback_is_public: None
) -> None:
    assert get(origin + "/hop/2") == PNG  # 3 redirects: the cap
    assert "redirected more than 3 times" in refused(origin + "/hop/3")
    assert "redirected more than 1 times" in refused(
        origin + "/hop/2", ImageLimits(allow_remote=True, max_redirects=1)
    )
    assert "'10.1.2.3' resolves to 10.1.2.3" in refused(origin + "/to-private")
    assert "must be http(s)" in refused(origin + "/to-file")


def test_a_slow_server_is_cut_at_the_timeout(origin: str, loopback_is_public: None) -> None:
    started = time.perf_counter()
    limits = ImageLimits(allow_remote=True, remote_timeout_s=0.3)
    message = refused(origin + "/slow", limits)
    assert "took over 0.3 s" in message or "ReadTimeout" in message
    assert time.perf_counter() - started < 2
    started = time.perf_counter()
    message = refused(origin + "/trickle", ImageLimits(allow_remote=True, remote_timeout_s=0.5))
    assert "took over 0.5 s" in message and "--remote-image-timeout" in message
    assert time.perf_counter() - started < 2


def test_remote_images_through_both_apis(origin: str, loopback_is_public: None) -> None:
    from starlette.testclient import TestClient

    from pagedkv.server.app import create_app

    engine = ImageEngine()
    app = create_app(engine, images=ImageLimits(allow_remote=True, remote_timeout_s=2.0))
    c = TestClient(app, raise_server_exceptions=False)
    part = {"type": "image_url", "image_url": {"url": origin + "/cat.png"}}
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [part]}]})
    assert r.status_code == 200, r.text
    assert image_parts_of(engine)[0]["image"].digest == image_from_pixels(pixels()).digest
    block = {"type": "image", "source": {"type": "url", "url": origin + "/to-private"}}
    body = {
        "model": "fake-model",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": [block]}],
    }
    r = c.post("/v1/messages", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages[0].content[0].source.url:")
    assert "not a public address" in r.json()["error"]["message"]
    block["source"]["url"] = origin + "/cat.png"  # type: ignore[index]
    assert c.post("/v1/messages", json=body).status_code == 200
