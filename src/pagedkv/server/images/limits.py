"""What one request's images may cost: bytes, pixels, count, and where they may come from.

The defaults bound one image's decoded RGB pixels to 48 MiB (`max_pixels` x 3 bytes)
and one request's to `max_images` times that; all requests' together to
`max_memory_bytes` (`budget.py`). Inline (data URL, base64) images also
count toward the body's own limits, `--max-body-bytes` and `--max-content-chars`,
which are checked first; only a fetched image is bounded by `max_bytes` alone.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's own cap on one image's file
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # 16.8 MP: past what vision processors keep
DEFAULT_MAX_IMAGE_SIDE = 8192
DEFAULT_MAX_IMAGES_PER_REQUEST = 8
DEFAULT_REMOTE_IMAGE_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
DEFAULT_MAX_IMAGE_MEMORY_BYTES = 1024 * 1024 * 1024  # about 21 images of the largest size


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """`max_bytes`: one image's file (decoded base64, or the body fetched); `max_pixels`
    and `max_side`: its size as its header states it, checked before any pixel is
    decoded; `max_images`: image parts in one request; `allow_remote`: http(s) URLs
    are fetched (off: only data URLs); `remote_timeout_s`: the whole fetch of one
    image, redirects included; `max_redirects`: redirects one fetch follows."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_side: int = DEFAULT_MAX_IMAGE_SIDE
    max_images: int = DEFAULT_MAX_IMAGES_PER_REQUEST
    allow_remote: bool = False
    remote_timeout_s: float = DEFAULT_REMOTE_IMAGE_TIMEOUT_S
    max_redirects: int = MAX_REDIRECTS
    # Decoded pixels of all requests in flight together (`budget.ImageMemory`).
    max_memory_bytes: int = DEFAULT_MAX_IMAGE_MEMORY_BYTES

    def __post_init__(self) -> None:
        for name, flag in _FLAGS.items():
            value = getattr(self, name)
            if value < (0 if name == "max_images" else 1):
                raise ValueError(
                    f"{flag} {value}: must be at least {0 if name == 'max_images' else 1}"
                )
        if self.remote_timeout_s <= 0:
            raise ValueError(f"--remote-image-timeout {self.remote_timeout_s}: must be positive")


_FLAGS = {
    "max_bytes": "--max-image-bytes",
    "max_pixels": "--max-image-pixels",
    "max_side": "--max-image-side",
    "max_images": "--max-images-per-request",
    "max_memory_bytes": "--max-image-memory-bytes",
}
