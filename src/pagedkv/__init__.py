"""pagedkv: a paged, persistent, shareable prefix KV cache for LLM inference.

The metadata layers (hashing, block pool) import without torch; the engine's
names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.pool import Block, BlockPool, BlockTable, PoolStats, PrefixMatch
from pagedkv.config import CacheConfig, parse_size
from pagedkv.errors import (
    CacheCorruptionError,
    EngineOverloadedError,
    ModelNotSupportedError,
    OutOfBlocksError,
    PagedKVError,
)

if TYPE_CHECKING:
    from pagedkv.engine import Engine, GenerationResult, SamplingParams, StreamEvent

_LAZY = {
    "Engine": "pagedkv.engine",
    "GenerationResult": "pagedkv.engine",
    "SamplingParams": "pagedkv.engine",
    "StreamEvent": "pagedkv.engine",
}

__version__ = "0.1.0"

__all__ = [
    "Block",
    "BlockHasher",
    "BlockPool",
    "BlockTable",
    "CacheConfig",
    "CacheCorruptionError",
    "Engine",
    "EngineOverloadedError",
    "ExtraKeys",
    "GenerationResult",
    "ModelNotSupportedError",
    "OutOfBlocksError",
    "PagedKVError",
    "PoolStats",
    "PrefixMatch",
    "SamplingParams",
    "StreamEvent",
    "parse_size",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
