"""Fetching a remote image (`--allow-remote-images`): public addresses only, bounded in
bytes, time and redirects.

Server-side request forgery is the risk: a URL naming a loopback, private,
link-local (cloud metadata at 169.254.169.254), multicast or reserved address
would make the server read its own network for the client. Each hop's host is
resolved here and every address it resolves to must be public (`public_address`);
the request then goes to that checked address, the URL's host kept in the Host
header and as the TLS server name (certificates are still checked against it),
so a DNS answer that changes between the check and the connection (rebinding)
reaches nothing. Redirects are followed by hand, each target checked the same
way, at most `max_redirects`. Proxies from the environment are not used (a proxy
would connect to a name we did not check). The body is read raw (identity
encoding asked; a compressed answer is refused, so no decompression bomb) and
reading stops past `max_bytes`; the whole fetch, redirects included, has
`remote_timeout_s`. Failures are 400s naming `param`: the URL is the client's.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import httpx

from pagedkv.server.http_errors import APIError, bad_request
from pagedkv.server.images.limits import ImageLimits

_ACCEPT = "image/png, image/jpeg, image/webp"


def _refuse(message: str, param: str) -> APIError:
    return bad_request(f"{param}: {message}", param, code="invalid_image_url")


def public_address(ip: str) -> bool:
    """True when `ip` is a public unicast address: not loopback, private, link-local,
    shared (CGNAT), multicast, reserved, unspecified or documentation, nor an IPv6
    address embedding such an IPv4 address (mapped, 6to4, Teredo)."""
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address):
        teredo = addr.teredo[1] if addr.teredo else None
        for inner in (addr.ipv4_mapped, addr.sixtofour, teredo):
            if inner is not None and not public_address(str(inner)):
                return False
        if addr.is_site_local:
            return False
    return addr.is_global and not (
        addr.is_multicast
        or addr.is_reserved
        or addr.is_loopback
        or addr.is_link_local
        or addr.is_unspecified
    )


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


async def fetch_image(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes at `url`, or APIError(400) naming `param`."""
    try:
        async with asyncio.timeout(limits.remote_timeout_s):
            return await _fetch(url, limits, param)
    except TimeoutError:
        raise _refuse(
            f"fetching the image took over {limits.remote_timeout_s:g} s, this server's "
            "limit (the operator can raise --remote-image-timeout); send it inline as a "
            "data URL",
            param,
        ) from None


async def _fetch(url: str, limits: ImageLimits, param: str) -> bytes:
    timeout = httpx.Timeout(limits.remote_timeout_s)
    async with httpx.AsyncClient(
        trust_env=False, follow_redirects=False, timeout=timeout
    ) as client:
        for _ in range(limits.max_redirects + 1):
            target = _http_url(url, param)
            request = await _pinned_request(client, target, param)
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise _refuse(
                    f"the image at {_shown(target)} could not be fetched "
                    f"({exc.__class__.__name__})",
                    param,
                ) from None
            try:
                if response.is_redirect:
                    url = str(target.join(response.headers["location"]))
                    continue
                return await _read_body(response, target, limits, param)
            finally:
                await response.aclose()
    raise _refuse(
        f"fetching the image was redirected more than {limits.max_redirects} times", param
    )


def _http_url(url: str, param: str) -> httpx.URL:
    try:
        target = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError):
        raise _refuse("the URL is not valid", param) from None
    if target.scheme not in ("http", "https") or not target.host:
        raise _refuse(
            f"an image URL must be http(s) with a host; got {_shown(target)} "
            "(redirects to other schemes are not followed)",
            param,
        )
    return target


async def _pinned_request(
    client: httpx.AsyncClient, target: httpx.URL, param: str
) -> httpx.Request:
    """A GET of `target` sent to an address of its host that is checked public."""
    host = target.raw_host.decode("ascii")
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        addresses = await resolve_host(host, port)
    except (OSError, UnicodeError):
        raise _refuse(f"the host {host!r} could not be resolved", param) from None
    refused = [a for a in addresses if not public_address(a)]
    if refused or not addresses:
        raise _refuse(
            f"the host {host!r} resolves to {refused[0] if refused else 'no address'}, which "
            "is not a public address; images are fetched from public addresses only",
            param,
        )
    extensions = {"sni_hostname": host} if target.scheme == "https" else {}
    headers = {
        "Host": target.netloc.decode("ascii"),
        "Accept": _ACCEPT,
        "Accept-Encoding": "identity",
        "User-Agent": "pagedkv",
    }
    return client.build_request(
        "GET", target.copy_with(host=addresses[0]), headers=headers, extensions=extensions
    )


async def _read_body(
    response: httpx.Response, target: httpx.URL, limits: ImageLimits, param: str
) -> bytes:
    if response.status_code != 200:
        raise _refuse(
            f"fetching {_shown(target)} answered HTTP {response.status_code}, not 200", param
        )
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise _refuse(
            f"the image at {_shown(target)} came compressed ({encoding!r}); only "
            "uncompressed (identity) answers are read",
            param,
        )
    too_big = _refuse(
        f"the image at {_shown(target)} is over this server's {limits.max_bytes} bytes "
        "(the operator can raise --max-image-bytes)",
        param,
    )
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise too_big
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > limits.max_bytes:
            raise too_big
    return bytes(body)


def _shown(url: httpx.URL) -> str:
    """The URL as an error shows it: without credentials or query, shortened."""
    shown = f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}{url.path}"
    return shown if len(shown) <= 200 else shown[:197] + "..."
