"""The contract every tier below RAM (SSD, Redis) implements.

A tier stores whole blocks: the keys and values of every layer for up to
`block_size` tokens, plus the metadata that lets a reader verify a hit (the
block's hash, its parent key, its token ids and the model namespace). Tiers
know nothing about models: a block's KV is one tensor
`[num_layers, 2, num_kv_heads, num_tokens, head_dim]` as the engine's KV format
stores it (the model's dtype, 16-bit floats, or 8-bit rows with their scales as bytes).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash


@dataclass(slots=True)
class BlockMeta:
    """What identifies a stored block.

    `parent_key` is the parent key the block's hash was computed from: the
    previous block's hash (or the chain's root for block 0), folded with this
    block's segment key when it has one. Children of one parent key are the
    blocks that may continue a prefix ending there, which is how partial tails
    are found. `token_ids` is int32, `num_tokens <= block_size` long.
    """

    block_hash: bytes
    parent_key: bytes
    token_ids: np.ndarray
    namespace: str

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(slots=True)
class KVBlock:
    """A block's metadata and its KV, `[num_layers, 2, kv_heads, num_tokens, head_dim]`."""

    meta: BlockMeta
    kv: torch.Tensor

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def block_checksum(block: KVBlock) -> bytes:
    """xxh3_128 over the KV bytes and every metadata field; 16 bytes."""
    h = xxhash.xxh3_128()
    h.update(block.meta.block_hash)
    h.update(block.meta.parent_key)
    h.update(np.ascontiguousarray(block.meta.token_ids, dtype=np.int32).tobytes())
    h.update(block.meta.namespace.encode())
    h.update(str(tuple(block.kv.shape)).encode() + str(block.kv.dtype).encode())
    kv = block.kv.detach().contiguous().cpu()
    h.update(kv.view(torch.uint8).numpy().data if kv.numel() else b"")
    return h.digest()


@dataclass
class TierStats:
    """Counters a tier keeps; all are totals since the tier was opened."""

    name: str
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    writes_dropped: int = 0
    corrupt: int = 0
    errors: int = 0
    num_blocks: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    location: str = ""  # a directory or host:port; never a password
    extra: dict[str, float | int | str | bool] = field(default_factory=dict)


class KVTier(ABC):
    """A store of whole KV blocks, addressed by block hash, shared by namespaces.

    Batched everywhere. The RAM tier is not one: it is the block pool's own
    store, addressed by block id (`pagedkv.cache.ram`).

    Rules every tier keeps:
    - `get` returns None for a block it does not have *or* cannot verify
      (checksum, shape, namespace); an unverifiable entry is removed and
      counted as `corrupt`. It never raises for a bad entry.
    - `put` never makes the caller wait on slow I/O for long: persistent tiers
      queue the write and drop it (counted in `writes_dropped`) when their
      write budget is full.
    - `children(parent_key)` lists the metadata (no KV) of stored blocks whose
      parent key is `parent_key`; the prefix cache uses it to find partial tails.
    - `clear(namespace)` removes that namespace's blocks and nothing else, so
      models sharing a directory or a Redis never wipe each other.
    - `seed(candidate)` returns the hashing seed the tier keeps for every engine
      that uses it, storing `candidate` when it has none; None when it cannot
      keep one (unreachable, read-only).
    """

    name: str = "tier"

    @abstractmethod
    def contains(self, hashes: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def get(self, hashes: Sequence[bytes]) -> list[KVBlock | None]: ...

    def get_each(
        self, hashes: Sequence[bytes], on_block: Callable[[int, KVBlock], object] | None
    ) -> list[KVBlock | None]:
        """`get`, calling `on_block(i, block)` on the calling thread for every block
        found. A tier that reads blocks one by one (SSD) calls it as each arrives, so
        the caller's copy overlaps the remaining reads; this default, after `get`."""
        blocks = self.get(hashes)
        if on_block is not None:
            for i, block in enumerate(blocks):
                if block is not None:
                    on_block(i, block)
        return blocks

    @abstractmethod
    def put(self, blocks: Sequence[KVBlock]) -> None: ...

    @abstractmethod
    def remove(self, hashes: Sequence[bytes]) -> None: ...

    @abstractmethod
    def children(self, parent_key: bytes) -> list[BlockMeta]: ...

    @abstractmethod
    def clear(self, namespace: str) -> int:
        """Remove every block of `namespace`; returns how many (or an estimate)."""

    @abstractmethod
    def seed(self, candidate: bytes) -> bytes | None: ...

    @abstractmethod
    def stats(self) -> TierStats: ...

    # -- leases (see `pagedkv.cache.leases`); a tier that cannot keep them ignores them

    def set_max_leased_fraction(self, fraction: float) -> None:  # noqa: B027
        """Leased blocks may keep at most `fraction` of the tier from eviction."""

    def lease(self, hashes: Sequence[bytes], ttl_s: float) -> None:  # noqa: B027
        """One more lease on the blocks `hashes` (present now or written later), for
        `ttl_s` seconds or until `release_lease`, renewals included: evict them after
        the unleased ones. Not called again on renewals."""

    def release_lease(self, hashes: Sequence[bytes]) -> None:  # noqa: B027
        """One lease on `hashes` lapsed (each `lease` call is released once)."""

    def check_seed(self, seed: bytes) -> bool:
        """True (with one warning) when the tier keeps another seed than `seed`, the
        one in use: its blocks cannot be found under this seed."""
        return False

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait up to `timeout` s for queued writes; True when none are left."""
        return True

    def close(self) -> None:  # noqa: B027 - a tier without resources needs no close
        """Flush within a bounded time and release files, sockets and threads."""
