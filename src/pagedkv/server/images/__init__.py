"""Images in chat requests: sources, limits, fetching, decoding (issue 32's input side)."""

from pagedkv.server.images.budget import ImageMemory
from pagedkv.server.images.decode import decode_image
from pagedkv.server.images.fetch import fetch_image, public_address
from pagedkv.server.images.limits import ImageLimits
from pagedkv.server.images.request import attach_images, image_content

__all__ = [
    "ImageLimits",
    "ImageMemory",
    "attach_images",
    "decode_image",
    "fetch_image",
    "image_content",
    "public_address",
]
