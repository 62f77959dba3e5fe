"""Where an image part's bytes are: inline base64 (a data URL, or Anthropic's `data`)
or a remote http(s) URL; every other scheme (file:, ftp:, a bare path) is refused.

Sizes are checked on the base64 text before it is decoded: 4 characters carry 3
bytes, so a text longer than `max_bytes` allows is refused without decoding it.
The base64 must be standard and unbroken (no line breaks, no URL-safe alphabet);
binascii checks that in C.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass

from pagedkv.server.http_errors import APIError, bad_request
from pagedkv.server.images.limits import ImageLimits

_HEADER_CHARS = 256  # a data URL's "data:<media type>[;params];base64," must fit in this


@dataclass(frozen=True, slots=True)
class InlineImage:
    """Base64 text of an image file, and the media type the client claimed (unused
    for decoding: the bytes' signature decides the format)."""

    base64: str
    claimed_type: str


@dataclass(frozen=True, slots=True)
class RemoteImage:
    url: str


ImageSource = InlineImage | RemoteImage


def _refuse(message: str, param: str) -> APIError:
    return bad_request(f"{param}: {message}", param, code="invalid_image")


def image_source(url: str, limits: ImageLimits, param: str) -> ImageSource:
    """The source an OpenAI `image_url.url` (or Anthropic `source.url`) names."""
    scheme = url[:8].split(":", 1)[0].lower() if ":" in url[:8] else ""
    if scheme == "data":
        return data_url(url, limits, param)
    if scheme in ("http", "https"):
        if not limits.allow_remote:
            raise _refuse(
                "this server does not fetch images from URLs; send the image inline as a "
                "data URL (data:image/png;base64,...), or the operator can start the "
                "server with --allow-remote-images",
                param,
            )
        return RemoteImage(url)
    if scheme == "file" or not scheme:
        raise _refuse(
            "local files are never read; send the image inline as a data URL "
            "(data:image/png;base64,...)",
            param,
        )
    raise _refuse(
        f"URLs of scheme {scheme!r} are not taken; send a data URL "
        "(data:image/png;base64,...) or an http(s) URL",
        param,
    )


def data_url(url: str, limits: ImageLimits, param: str) -> InlineImage:
    """A `data:[<media type>];base64,<data>` URL's parts; its size checked, not decoded."""
    comma = url.find(",", 0, _HEADER_CHARS)
    if comma < 0:
        raise _refuse("a data URL is data:<media type>;base64,<data>; no ',' was found", param)
    header = url[5:comma]
    kind, sep, encoding = header.rpartition(";")
    if not sep or encoding.lower() != "base64":
        raise _refuse(
            "only base64 data URLs are taken (data:image/png;base64,...); this one is "
            "not marked ';base64'",
            param,
        )
    text = url[comma + 1 :]
    check_base64_size(text, limits, param)
    return InlineImage(text, kind.split(";", 1)[0].strip().lower())


def check_base64_size(text: str, limits: ImageLimits, param: str) -> None:
    if not text:
        raise _refuse("the image data is empty", param)
    most = 4 * -(-limits.max_bytes // 3)
    if len(text) > most:
        raise _refuse(
            f"the image data is {len(text)} base64 characters, over the {most} that "
            f"carry this server's {limits.max_bytes} bytes per image (the operator can "
            "raise --max-image-bytes)",
            param,
        )


def decode_base64(text: str, param: str) -> bytes:
    """The bytes of standard base64 `text`; a 400 naming `param` when it is not."""
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise _refuse(
            f"the image data is not valid base64 ({exc}); send standard base64 without line breaks",
            param,
        ) from None
