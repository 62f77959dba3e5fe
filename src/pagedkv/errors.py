"""Typed errors. Messages say what was asked, what was there, and what to do."""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class OutOfBlocksError(PagedKVError):
    """The block pool cannot hand out the blocks asked for."""

    def __init__(self, asked: int, available: int, max_blocks: int) -> None:
        self.asked = asked
        self.available = available
        self.max_blocks = max_blocks
        super().__init__(
            f"asked for {asked} KV blocks but only {available} can be freed or grown "
            f"(pool limit max_blocks={max_blocks}, the rest are referenced by running "
            "requests); raise the RAM cache budget or lower concurrency"
        )


class CacheCorruptionError(PagedKVError):
    """A stored block failed verification (checksum, token ids, shape)."""


class ModelNotSupportedError(PagedKVError):
    """The model cannot be loaded or cannot use prefix caching."""


class EngineOverloadedError(PagedKVError):
    """The request queue is full; the caller should retry later."""

    def __init__(self, queued: int, max_queue: int) -> None:
        self.queued = queued
        self.max_queue = max_queue
        super().__init__(
            f"the engine has {queued} requests queued (limit {max_queue}); retry shortly"
        )


class EngineClosedError(PagedKVError):
    """The engine was closed (or is shutting down) and takes no more requests."""
