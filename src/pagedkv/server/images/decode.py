"""Image bytes to an `ImageInput`: PNG, JPEG and WebP only, sized from the header first.

The format is read from the bytes' own signature, never from a media type the
client claims (a data URL's `image/jpeg` on PNG bytes decodes as the PNG it is),
and only that format's Pillow plugin opens them: of Pillow's forty-odd parsers,
three ever see a client's bytes. `Image.open` reads the header only, so the
size is checked against `ImageLimits` before a pixel is decoded; Pillow's own
decompression-bomb error and warning (it raises at twice its threshold and warns
past it, both far above ours) become the same 400. Animated images (APNG,
animated WebP) are refused rather than cut to their first frame, which would
answer about a picture the client did not send. A JPEG's EXIF orientation is
applied, as a viewer shows it; the digest covers the upright pixels.

Every refusal is `APIError(400)` naming `param`: blocking (the pixels are
decoded here), so callers run it off the event loop.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, ImageOps

from pagedkv.model.images import ImageInput, image_from_pixels
from pagedkv.server.http_errors import APIError, bad_request
from pagedkv.server.images.budget import ImageMemory
from pagedkv.server.images.limits import ImageLimits

ACCEPTED = "PNG, JPEG or WebP"
_NAMES = {"WEBP": "WebP"}

# (signature at offset 0, Pillow's format name); WebP is RIFF....WEBP, checked apart.
_ACCEPTED_MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"))
_REFUSED_MAGIC = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"%PDF", "PDF"),
)


def _refuse(message: str, param: str) -> APIError:
    return bad_request(f"{param}: {message}", param, code="invalid_image")


def sniff_format(data: bytes) -> str | None:
    """The format the bytes' signature names: PNG, JPEG, WEBP (Pillow's names), a
    refused format's name (GIF, BMP, SVG...), or None when none is recognised."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    for magic, name in (*_ACCEPTED_MAGIC, *_REFUSED_MAGIC):
        if data.startswith(magic):
            return name
    if data[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" or data[4:12] in (b"ftypavif", b"ftypheic"):
        return "AVIF/HEIC/JPEG 2000"
    head = data[:256].lstrip().lower()
    if head.startswith((b"<?xml", b"<svg")) or b"<svg" in head:
        return "SVG"
    return None


def decode_image(
    data: bytes, limits: ImageLimits, param: str, memory: ImageMemory | None = None
) -> ImageInput:
    """Decode `data` to RGB pixels and their digest, or raise APIError(400) naming `param`.
    `memory`: the server's budget of decoded pixels, reserved from the header's size
    before decoding and held until the pixels are freed (503 when it is full)."""
    if len(data) > limits.max_bytes:
        raise _refuse(
            f"the image is {len(data)} bytes, over this server's {limits.max_bytes} "
            "(the operator can raise --max-image-bytes)",
            param,
        )
    fmt = sniff_format(data)
    if fmt is None:
        raise _refuse(f"the data is not an image this server recognises; send {ACCEPTED}", param)
    if fmt not in ("PNG", "JPEG", "WEBP"):
        raise _refuse(f"{fmt} images are not accepted; send {ACCEPTED}", param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=[fmt])
            _check_size(image.size, limits, param)
            _check_still(image, param)
            width, height = image.size
            held = None if memory is None else memory.reserve(3 * width * height, param)
            try:
                image.load()
                upright = ImageOps.exif_transpose(image) if fmt == "JPEG" else image
                decoded = image_from_pixels(upright)
            except BaseException:
                if held is not None:
                    held.release()
                raise
            if held is not None:
                held.keep_until_freed(decoded.pixels)
            return decoded
    except APIError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _refuse(
            f"the image's size is over this server's limit of {limits.max_pixels} pixels "
            f"({exc.__class__.__name__})",
            param,
        ) from None
    except MemoryError:
        raise _refuse("the image is too large to decode", param) from None
    except Exception as exc:  # Pillow's errors on bad data: OSError, SyntaxError, ValueError...
        raise _refuse(
            f"the {_NAMES.get(fmt, fmt)} data could not be decoded (it is truncated or corrupt: "
            f"{exc.__class__.__name__}); send a whole {ACCEPTED} file",
            param,
        ) from None


def _check_size(size: tuple[int, int], limits: ImageLimits, param: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise _refuse(f"the image is {width}x{height} pixels: empty", param)
    if max(width, height) > limits.max_side:
        raise _refuse(
            f"the image is {width}x{height} pixels; a side may be at most "
            f"{limits.max_side} pixels (the operator can raise --max-image-side)",
            param,
        )
    if width * height > limits.max_pixels:
        raise _refuse(
            f"the image is {width}x{height} = {width * height} pixels, over this server's "
            f"{limits.max_pixels} (the operator can raise --max-image-pixels); send a "
            "smaller image",
            param,
        )


def _check_still(image: Image.Image, param: str) -> None:
    """Refuse an animation. A JPEG's extra pictures (MPO: a camera's depth map or
    preview) are not an animation: its first picture is the photograph."""
    frames = getattr(image, "n_frames", 1)
    if frames > 1 and image.format != "MPO":
        raise _refuse(
            f"the image is animated ({frames} frames); send a still image",
            param,
        )
