"""The server-wide budget of decoded image pixels in memory (`--max-image-memory-bytes`).

One request may hold `max_images` decoded images of up to `max_pixels` x 3 bytes each
(8 x 48 MiB by default), from its decode until its body is dropped (after the reply,
or after the next-turn store that re-renders it). Many such requests at once would
exhaust RAM; this budget bounds their sum. Each image reserves its RGB size, from its
header, before a pixel is decoded, and the reservation is released when its pixels
are freed (`weakref.finalize` on the pixels' object), so it follows what memory
really holds whichever route kept the image and however long. A request that does not
fit gets 503 `image_memory_full` with Retry-After at once, rather than waiting with
its body in memory; an image that could never fit is a 400.

Rejected: releasing at the end of each route, which misses the holders that outlive
the route (a streaming reply, the next-turn store) and would need every route to
remember to release. A reservation whose pixels sit in a reference cycle would be
released only by the garbage collector: a refusal first runs one collection (at most
one a second) and tries again. The processor's own tensors of a rendered image
(smaller: the model's input size) and the vision cache (`--vision-cache-bytes`) are
bounded apart."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import Any

from pagedkv.server.http_errors import APIError, bad_request
from pagedkv.server.images.limits import DEFAULT_MAX_IMAGE_MEMORY_BYTES

RETRY_AFTER_S = 1
COLLECT_EVERY_S = 1.0


class ImageMemory:
    """Bytes of decoded pixels held, within `capacity_bytes`. Thread-safe: decodes run
    on the render pool's threads and finalizers run wherever the last reference goes.

    Invariant: `in_use_bytes` is the sum of the reservations not yet released and
    never exceeds `capacity_bytes`."""

    def __init__(self, capacity_bytes: int = DEFAULT_MAX_IMAGE_MEMORY_BYTES) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"--max-image-memory-bytes {capacity_bytes}: must be at least 1")
        self.capacity_bytes = capacity_bytes
        self.in_use_bytes = 0
        self.refused = 0
        self._collected = -COLLECT_EVERY_S  # when _collect last ran (time.monotonic)
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, param: str) -> Reservation:
        """Reserve `nbytes` for one image named `param`, or raise its APIError."""
        if nbytes > self.capacity_bytes:
            raise bad_request(
                f"{param}: the image decodes to {nbytes} bytes of pixels, over this "
                f"server's {self.capacity_bytes} for all images in flight (the operator can "
                "raise --max-image-memory-bytes); send a smaller image",
                param,
                code="invalid_image",
            )
        if not self._take(nbytes):
            self._collect()
            if not self._take(nbytes):
                with self._lock:
                    self.refused += 1
                    used = self.in_use_bytes
                raise APIError(
                    503,
                    f"{param}: the server holds {used} of its {self.capacity_bytes} bytes "
                    f"for decoded images in flight, and this image needs {nbytes} more; "
                    "retry shortly (the operator can raise --max-image-memory-bytes)",
                    param=param,
                    code="image_memory_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
        return Reservation(self, nbytes)

    def _collect(self) -> None:
        """A garbage collection (reservations whose pixels are only in a reference
        cycle), at most once per `COLLECT_EVERY_S`: a client sending image after image
        into a full budget must not make the server collect its whole heap each time."""
        now = time.monotonic()
        with self._lock:
            if now - self._collected < COLLECT_EVERY_S:
                return
            self._collected = now
        gc.collect()

    def _take(self, nbytes: int) -> bool:
        with self._lock:
            if self.in_use_bytes + nbytes > self.capacity_bytes:
                return False
            self.in_use_bytes += nbytes
            return True

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.in_use_bytes -= nbytes


class Reservation:
    """One image's bytes: `keep_until_freed(pixels)` hands them to the pixels' lifetime;
    `release()` gives them back at once (a decode that failed). Released once."""

    def __init__(self, budget: ImageMemory, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes
        self._done = False
        self._lock = threading.Lock()

    def keep_until_freed(self, pixels: Any) -> None:
        weakref.finalize(pixels, self.release)

    def release(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._budget._give(self.nbytes)
