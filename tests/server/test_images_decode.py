"""server/images/decode.py and source.py: what bytes become an ImageInput, and the 400s
(with the field's name) for everything else, refused before pixels are decoded."""

from __future__ import annotations

import time

import pytest
from image_files import animated, b64, encode, pixels, png_header_claiming
from PIL import Image

from pagedkv.model.images import image_from_pixels
from pagedkv.server.http_errors import APIError
from pagedkv.server.images.decode import decode_image, sniff_format
from pagedkv.server.images.limits import ImageLimits
from pagedkv.server.images.source import InlineImage, data_url, decode_base64, image_source

PARAM = "messages[0].content[1].image_url.url"
LIMITS = ImageLimits()


def refused(data: bytes, limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(APIError) as caught:
        decode_image(data, limits, PARAM)
    assert caught.value.status == 400 and caught.value.param == PARAM
    assert caught.value.message.startswith(PARAM + ": ")
    return caught.value.message


def test_png_and_lossless_webp_of_the_same_pixels_are_one_image() -> None:
    image = pixels()
    png = decode_image(encode(image, "PNG"), LIMITS, PARAM)
    webp = decode_image(encode(image, "WEBP", lossless=True), LIMITS, PARAM)
    assert png.size == webp.size == image.size
    assert png.digest == webp.digest == image_from_pixels(image).digest
    assert png.pixels.tobytes() == image.tobytes()


def test_different_pixels_have_different_digests_and_jpeg_decodes() -> None:
    a = decode_image(encode(pixels(seed=1), "PNG"), LIMITS, PARAM)
    b = decode_image(encode(pixels(seed=2), "PNG"), LIMITS, PARAM)
    assert a.digest != b.digest
    jpeg = decode_image(encode(pixels(seed=1), "JPEG", quality=95), LIMITS, PARAM)
    assert jpeg.size == (16, 12) and jpeg.pixels.mode == "RGB"
    assert jpeg.digest != a.digest  # lossy: other pixels, another image


def test_modes_other_than_rgb_are_converted() -> None:
    grey = Image.new("L", (5, 4), 77)
    rgba = Image.new("RGBA", (5, 4), (10, 20, 30, 255))
    for image in (grey, rgba, grey.convert("P")):
        decoded = decode_image(encode(image, "PNG"), LIMITS, PARAM)
        assert decoded.pixels.mode == "RGB" and decoded.size == (5, 4)
    assert decode_image(encode(rgba, "PNG"), LIMITS, PARAM).pixels.getpixel((0, 0)) == (10, 20, 30)


def test_a_jpeg_is_turned_upright_by_its_exif_orientation() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    data = encode(Image.new("RGB", (8, 2)), "JPEG", exif=exif)
    assert decode_image(data, LIMITS, PARAM).size == (2, 8)


@pytest.mark.parametrize(
    ("fmt", "name"), [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF"), ("ICO", "ICO")]
)
def test_formats_other_than_png_jpeg_webp_are_refused_by_name(fmt: str, name: str) -> None:
    message = refused(encode(pixels(), fmt))
    assert f"{name} images are not accepted" in message and "PNG, JPEG or WebP" in message


def test_svg_and_unknown_bytes_are_refused() -> None:
    svg = b'<?xml version="1.0"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="9"/>'
    assert "SVG images are not accepted" in refused(svg)
    assert "not an image this server recognises" in refused(b"hello, world")
    assert "not an image" in refused(b"")


def test_the_format_is_read_from_the_bytes_not_the_claimed_type() -> None:
    url = data_url("data:image/jpeg;base64," + b64(encode(pixels(), "PNG")), LIMITS, PARAM)
    assert url.claimed_type == "image/jpeg"
    decoded = decode_image(decode_base64(url.base64, PARAM), LIMITS, PARAM)
    assert decoded.digest == image_from_pixels(pixels()).digest


def test_a_truncated_or_corrupt_image_is_a_400_not_a_500() -> None:
    whole = encode(pixels((64, 64)), "PNG")
    assert "could not be decoded" in refused(whole[: len(whole) // 2])
    corrupt = bytearray(encode(pixels((64, 64)), "JPEG"))
    corrupt[200:] = b"\x00" * (len(corrupt) - 200)
    try:  # a JPEG with zeroed scans may still decode (grey); it must never be a 500
        decode_image(bytes(corrupt), LIMITS, PARAM)
    except APIError as exc:
        assert exc.status == 400
    webp = encode(pixels((64, 64)), "WEBP")
    assert "could not be decoded" in refused(webp[:40])


def test_a_huge_claimed_size_is_refused_from_the_header_before_decoding() -> None:
    started = time.perf_counter()
    # 100000 x 100000 would be 30 GB of RGB: Pillow's own bomb check fires first.
    assert "pixels" in refused(png_header_claiming(100_000, 100_000))
    # Under Pillow's threshold, over ours: our message, with the size.
    message = refused(png_header_claiming(5000, 5000))
    assert "5000x5000 = 25000000 pixels" in message and "--max-image-pixels" in message
    assert "--max-image-side" in refused(png_header_claiming(9000, 10))
    assert time.perf_counter() - started < 2  # no pixel of them was decoded


def test_the_limits_apply_as_configured() -> None:
    data = encode(pixels((40, 30)), "PNG")
    assert "1200 pixels, over this server's 1000" in refused(data, ImageLimits(max_pixels=1000))
    assert "at most 32 pixels" in refused(data, ImageLimits(max_side=32))
    assert "--max-image-bytes" in refused(data, ImageLimits(max_bytes=len(data) - 1))
    assert decode_image(data, ImageLimits(max_pixels=1200, max_side=40, max_bytes=len(data)), PARAM)


@pytest.mark.parametrize("fmt", ["WEBP", "PNG"])
def test_animated_images_are_refused(fmt: str) -> None:
    assert "animated (3 frames)" in refused(animated(fmt))


def test_sniffing_names_the_formats() -> None:
    assert sniff_format(encode(pixels(), "PNG")) == "PNG"
    assert sniff_format(encode(pixels(), "JPEG")) == "JPEG"
    assert sniff_format(encode(pixels(), "WEBP")) == "WEBP"
    assert sniff_format(encode(pixels(), "GIF")) == "GIF"
    assert sniff_format(b"RIFF\x00\x00\x00\x00WAVEfmt ") is None


def source_refused(url: str, limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(APIError) as caught:
        image_source(url, limits, PARAM)
    assert caught.value.status == 400 and caught.value.param == PARAM
    return caught.value.message


def test_image_sources_by_scheme() -> None:
    assert isinstance(image_source("data:image/png;base64,AAAA", LIMITS, PARAM), InlineImage)
    assert "--allow-remote-images" in source_refused("https://example.com/a.png")
    assert image_source("HTTPS://example.com/a.png", ImageLimits(allow_remote=True), PARAM)
    for local in ("file:///etc/passwd", "/etc/passwd", "cat.png"):
        assert "local files are never read" in source_refused(local)
    assert "'ftp'" in source_refused("ftp://example.com/a.png")
    assert "';base64'" in source_refused("data:image/png,rawbytes")
    assert "no ','" in source_refused("data:image/png;base64")


def test_base64_is_sized_before_it_is_decoded_and_must_be_standard() -> None:
    limits = ImageLimits(max_bytes=300)
    assert image_source("data:image/png;base64," + "A" * 400, limits, PARAM)  # 300 bytes
    message = source_refused("data:image/png;base64," + "A" * 404, limits)
    assert "404 base64 characters" in message and "--max-image-bytes" in message
    assert "empty" in source_refused("data:image/png;base64,")
    for bad in ("@@@@", "AAA", "AA\nAA", "a-_b"):
        with pytest.raises(APIError, match="not valid base64"):
            decode_base64(bad, PARAM)
