"""The images' encoder outputs, kept in RAM by their segment key, least recently used
out first, within a byte budget.

An image's rows (what the vision encoder and its projector make of it, the inputs the
language model reads at its placeholder tokens) depend only on its pixels, the
processor settings and the model, and the segment key names all three (the model by
the engine's one namespace). So a conversation that sends the same image again, or a
prompt whose cached prefix ends inside an image, reads them here instead of running
the encoder. Only the worker thread reads and writes it; the figures are read from any
thread (plain ints)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagedkv.config import DEFAULT_VISION_CACHE_BYTES


@dataclass(frozen=True, slots=True)
class VisionCacheStats:
    """Hits and misses since start, and what the cache holds now."""

    hits: int
    misses: int
    entries: int
    bytes: int
    capacity_bytes: int
    encoder_calls: int


class VisionCache:
    """Encoder rows by segment key, LRU by bytes.

    Invariants: `bytes` is the sum of the held tensors' sizes and never exceeds
    `capacity_bytes` after a `put` returns; a tensor larger than the whole budget is
    not kept (the request still gets it: the cache only decides what outlives it).
    Capacity 0 keeps nothing."""

    def __init__(self, capacity_bytes: int = DEFAULT_VISION_CACHE_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"vision cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.encoder_calls = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        rows = self._rows.get(key)
        if rows is None:
            self.misses += 1
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        return rows

    def put(self, key: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        old = self._rows.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        if size > self.capacity_bytes:
            return
        self._rows[key] = rows
        self.bytes += size
        self._shrink()

    def resize(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"vision cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._shrink()

    def clear(self) -> None:
        self._rows.clear()
        self.bytes = 0

    def _shrink(self) -> None:
        while self.bytes > self.capacity_bytes:
            _, rows = self._rows.popitem(last=False)
            self.bytes -= rows.numel() * rows.element_size()

    def __len__(self) -> int:
        return len(self._rows)

    def stats(self) -> VisionCacheStats:
        return VisionCacheStats(
            hits=self.hits,
            misses=self.misses,
            entries=len(self._rows),
            bytes=self.bytes,
            capacity_bytes=self.capacity_bytes,
            encoder_calls=self.encoder_calls,
        )
