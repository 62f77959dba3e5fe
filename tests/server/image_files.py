"""Image files made in the test, for the image input tests: real encodings by Pillow,
and hand-built headers that claim sizes no test should ever allocate."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib

from PIL import Image


def pixels(size: tuple[int, int] = (16, 12), seed: int = 0) -> Image.Image:
    """Noise, so that lossless formats cannot hide a bug behind a flat colour."""
    rng = random.Random(seed)
    return Image.frombytes(
        "RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3))
    )


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_claiming(width: int, height: int) -> bytes:
    """A PNG whose IHDR (valid CRC) claims width x height RGB pixels, followed by a tiny
    IDAT: decoding it for real would allocate width*height*3 bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", ihdr)
        + _chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + _chunk(b"IEND", b"")
    )


def animated(fmt: str, frames: int = 3) -> bytes:
    images = [pixels((8, 8), seed=i) for i in range(frames)]
    return encode(
        images[0], fmt, save_all=True, append_images=images[1:], duration=100, lossless=True
    )
