"""An in-memory `KVTier` for unit tests of the prefix cache and the lower-tier walk,
with a switch to fail every call and a log of what was read and written."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.cache.ram import KVLayout
from pagedkv.storage.base import BlockMeta, KVBlock, KVTier, TierStats


class MemoryTier(KVTier):
    def __init__(self, name: str = "mem") -> None:
        self.name = name
        self.blocks: dict[bytes, KVBlock] = {}
        self.fail = False
        self.puts: list[bytes] = []
        self.gets: list[bytes] = []
        self.kept_seed: bytes | None = None

    def _check(self) -> None:
        if self.fail:
            raise OSError(f"tier {self.name} is broken (injected)")

    def contains(self, hashes: Sequence[bytes]) -> list[bool]:
        self._check()
        return [h in self.blocks for h in hashes]

    def get(self, hashes: Sequence[bytes]) -> list[KVBlock | None]:
        self._check()
        self.gets.extend(hashes)
        return [self.blocks.get(h) for h in hashes]

    def put(self, blocks: Sequence[KVBlock]) -> None:
        self._check()
        for block in blocks:
            self.puts.append(block.meta.block_hash)
            self.blocks[block.meta.block_hash] = KVBlock(block.meta, block.kv.clone())

    def remove(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.blocks.pop(h, None)

    def children(self, parent_key: bytes) -> list[BlockMeta]:
        self._check()
        return [b.meta for b in self.blocks.values() if b.meta.parent_key == parent_key]

    def clear(self, namespace: str) -> int:
        gone = [h for h, b in self.blocks.items() if b.meta.namespace == namespace]
        self.remove(gone)
        return len(gone)

    def seed(self, candidate: bytes) -> bytes | None:
        if self.kept_seed is None:
            self.kept_seed = candidate
        return self.kept_seed

    def stats(self) -> TierStats:
        return TierStats(self.name, num_blocks=len(self.blocks))


def fake_kv(layout: KVLayout, tokens: Sequence[int]) -> torch.Tensor:
    """A stand-in for a model's KV of `tokens`: position p holds a value made of the
    token at p and every token before it, so equal prefixes give equal KV and any
    difference earlier in the sequence changes everything after it, as in a model."""
    prefix = torch.tensor(list(tokens), dtype=torch.float64).cumsum(0)
    per_token = (prefix * 1e-3 + torch.arange(len(tokens))).to(layout.dtype)
    shape = (layout.num_layers, 2, layout.num_kv_heads, len(tokens), layout.head_dim)
    return per_token.view(1, 1, 1, -1, 1).expand(shape).contiguous()
