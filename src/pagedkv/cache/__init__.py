"""The KV cache core: hashing, the block pool, the RAM block store, the lower-tier
walk and the per-request prefix cache.

The metadata layers (hashing, block, pool) import without torch; the names that
need torch load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedkv.cache.block import Block
from pagedkv.cache.hashing import BlockHasher, ExtraKeys, HashChain
from pagedkv.cache.pool import BlockPool, BlockTable, PoolStats, PrefixMatch

if TYPE_CHECKING:
    from pagedkv.cache.prefix import PrefixCache, RequestCache

_LAZY = {"PrefixCache": "pagedkv.cache.prefix", "RequestCache": "pagedkv.cache.prefix"}

__all__ = [
    "Block",
    "BlockHasher",
    "BlockPool",
    "BlockTable",
    "ExtraKeys",
    "HashChain",
    "PoolStats",
    "PrefixCache",
    "PrefixMatch",
    "RequestCache",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedkv.cache' has no attribute {name!r}")
