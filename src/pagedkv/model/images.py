"""An image of a prompt, decoded: its RGB pixels and the digest that names them.

The digest covers the decoded pixels, not the file's bytes: the same picture sent as
PNG and as lossless WebP is one image, and two files that decode alike share KV. What
the model's processor does with the pixels (its resize and patch settings) is folded in
where the image's segment key is made, not here."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from PIL import Image

DIGEST_TAG = b"pagedkv-image-v1"


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a request: RGB `pixels` (loaded) and their 32-byte `digest`."""

    pixels: Image.Image
    digest: bytes

    @property
    def size(self) -> tuple[int, int]:
        return self.pixels.size


def image_from_pixels(pixels: Image.Image) -> ImageInput:
    """An `ImageInput` of decoded pixels: converted to RGB, digested as
    sha256(tag | width | height | RGB bytes), width and height as 4-byte little-endian."""
    rgb = pixels if pixels.mode == "RGB" else pixels.convert("RGB")
    width, height = rgb.size
    digest = hashlib.sha256(DIGEST_TAG)
    digest.update(width.to_bytes(4, "little") + height.to_bytes(4, "little"))
    digest.update(rgb.tobytes())
    return ImageInput(pixels=rgb, digest=digest.digest())
