"""pagedkv: a paged, persistent, shareable prefix KV cache for LLM inference.

The metadata layers (hashing, block pool) import without torch; the engine's
names load on first use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# AMX tiles (Sapphire Rapids and later) make oneDNN's bfloat16 products round a row
# differently with the number of rows, at any count (measured on a Xeon with AMX:
# rows among 256, 300 or 512 differ from the same rows among 1100, and most counts
# under 80 differ too), so no padding keeps a sequence's KV independent of what
# else runs and cached == fresh fails in bfloat16. Capped at AVX512-BF16, the same
# products are bit-identical at every count measured (1-80, 100-1100). oneDNN reads
# the cap at its first product, so it is set here, before any pagedkv module runs
# one; an operator's own ONEDNN_MAX_CPU_ISA wins, and is part of the linear
# kernel's name in the namespace (`model/linear.py`). Rejected: fixed-size row
# tiles through AMX (every product padded to one row count).
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
from pagedkv.cache.hashing import BlockHasher, ExtraKeys
from pagedkv.cache.pool import Block, BlockPool, BlockTable, PoolStats, PrefixMatch
from pagedkv.config import CacheConfig, cache_home, parse_size

# Where inductor keeps its build files (the compiled decode step's, `model.compiled`,
# whose finished package goes to the user cache's `compiled/`): under pagedkv's user
# cache rather than /tmp, so a rebuild after a restart reuses them. torch reads it once,
# at its first compile-related import (transformers' import may make it), so it is set
# here, before anything of pagedkv imports torch.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_home() / "inductor"))
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
