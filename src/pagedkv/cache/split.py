"""A block's sliding-layer KV stored apart from the rest in the lower tiers.

RAM keeps every layer of a block in one slab slot. SSD and Redis keep a block of a
model with sliding-window layers as two stored entries: the block itself (hash,
parent key, token ids, the KV of its full-attention layers, `[Lf, 2, H, n, D]`,
Lf possibly 0) and its window part (the KV of its sliding layers, `[Ls, 2, H, n,
D]`) under a derived hash and parent key. A restore of n tokens reads the block
entries of the whole prefix (the full layers need them all) and the window parts
of the blocks in the widest window only, so it reads for the sliding layers their
window plus at most one block, as from RAM. Rejected: byte-range reads of one
stored entry, which neither Redis values nor the verified SSD file reads offer.

A window part that a tier lost (evicted, a dropped write) ends the restore at
the block before it; the tier formats did not change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.storage.base import BlockMeta, KVBlock, KVTier

_PART_TAG = b"pagedkv-window/"
_PARENT_TAG = b"pagedkv-window-parent/"


class WindowSplit:
    """Which KV layers are sliding, and the stored window parts of blocks."""

    def __init__(self, windows: Sequence[int | None], kv_shape: tuple[int, int, int, int]) -> None:
        self.windows = tuple(windows)
        self.full_rows = [i for i, w in enumerate(self.windows) if w is None]
        self.slide_rows = [i for i, w in enumerate(self.windows) if w is not None]
        self.max_window = max(w for w in self.windows if w is not None)
        self.kv_shape = kv_shape  # (num_layers, 2, kv_heads, head_dim) of the whole block
        self._full = torch.tensor(self.full_rows, dtype=torch.long)
        self._slide = torch.tensor(self.slide_rows, dtype=torch.long)

    def first_block(self, num_tokens: int, block_size: int) -> int:
        """The first block any sliding layer needs for a restore of `num_tokens`."""
        return max(0, num_tokens - self.max_window + 1) // block_size

    def split(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole block's KV `[L, ...]` as (its full layers' KV, its sliding layers')."""
        return kv.index_select(0, self._full), kv.index_select(0, self._slide)

    def merge(self, main: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        shape = (len(self.windows), *main.shape[1:])
        out = torch.empty(shape, dtype=main.dtype)
        out.index_copy_(0, self._full, main)
        out.index_copy_(0, self._slide, window)
        return out

    @staticmethod
    def part_key(block_hash: bytes) -> bytes:
        return hashlib.blake2b(_PART_TAG + block_hash, digest_size=len(block_hash)).digest()

    @staticmethod
    def _part_parent(block_hash: bytes) -> bytes:
        return hashlib.blake2b(_PARENT_TAG + block_hash, digest_size=len(block_hash)).digest()

    def part_block(self, meta: BlockMeta, window: torch.Tensor) -> KVBlock:
        key, parent = self.part_key(meta.block_hash), self._part_parent(meta.block_hash)
        return KVBlock(BlockMeta(key, parent, meta.token_ids, meta.namespace), window)

    def fetch(
        self, tiers: Sequence[KVTier], metas: Sequence[BlockMeta]
    ) -> list[torch.Tensor | None]:
        """The window parts of the blocks `metas` (None where no tier has a verified
        one), each tier asked only for what the tiers before it lacked."""
        out: list[torch.Tensor | None] = [None] * len(metas)
        _, two, H, D = self.kv_shape
        for tier in tiers:
            todo = [i for i, kv in enumerate(out) if kv is None]
            if not todo:
                break
            got = tier.get([self.part_key(metas[i].block_hash) for i in todo])
            for i, blk in zip(todo, got, strict=True):
                meta = metas[i]
                if (
                    blk is not None
                    and blk.meta.block_hash == self.part_key(meta.block_hash)
                    and blk.meta.parent_key == self._part_parent(meta.block_hash)
                    and np.array_equal(blk.meta.token_ids, meta.token_ids)
                    and tuple(blk.kv.shape) == (len(self.slide_rows), two, H, meta.num_tokens, D)
                ):
                    out[i] = blk.kv
        return out

    def fetch_windows(
        self, tiers: Sequence[KVTier], blocks: Sequence[KVBlock], base: int, n: int, bs: int
    ) -> tuple[int, list[torch.Tensor | None]]:
        """The window parts of the lower-tier `blocks` (block `base` the first of them)
        that a restore of `n` tokens needs, and how many tokens can be restored: a
        missing part ends the restore before its block, which moves the window
        earlier, so the walk repeats until nothing is missing."""
        parts: list[torch.Tensor | None] = [None] * len(blocks)
        tried = [False] * len(blocks)
        while True:
            lo = max(self.first_block(n, bs), base)
            hi = min(-(-n // bs), base + len(blocks))
            todo = [j for j in range(lo, hi) if not tried[j - base]]
            if todo:
                got = self.fetch(tiers, [blocks[j - base].meta for j in todo])
                for j, kv in zip(todo, got, strict=True):
                    parts[j - base], tried[j - base] = kv, True
            missing = next((j for j in range(lo, hi) if parts[j - base] is None), None)
            if missing is None:
                return n, parts
            n = missing * bs

    def whole(
        self,
        tiers: Sequence[KVTier],
        mains: Sequence[torch.Tensor],
        metas: Sequence[BlockMeta],
        parts: list[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        """Lower-tier blocks' KV with every layer, for RAM: the parts a restore did not
        need are fetched now (after the first token, off its time); the list ends
        before the first block whose part no tier has."""
        missing = [i for i in range(len(mains)) if i >= len(parts) or parts[i] is None]
        parts = list(parts) + [None] * (len(mains) - len(parts))
        if missing:
            for i, kv in zip(missing, self.fetch(tiers, [metas[i] for i in missing]), strict=True):
                parts[i] = kv
        out = []
        for main, part in zip(mains, parts, strict=True):
            if part is None:
                break
            out.append(self.merge(main, part))
        return out
