"""The tiers below RAM (SSD, then Redis), walked block by block."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.storage.base import BlockMeta, KVBlock, KVTier


@dataclass(slots=True)
class Found:
    """A verified block from a lower tier, with the name of the tier it came from."""

    tier: str
    block: KVBlock


class LowerTiers:
    """SSD and Redis behind the RAM tier.

    Every block a tier returns is checked against what the request expects
    (hash, parent key, token ids, KV shape) before it is used: a tier's own
    checksum proves the bytes are intact, this proves they are the right bytes.
    A block that fails is a miss. Lookups stop at the first block no tier has.
    """

    def __init__(self, tiers: Sequence[KVTier], kv_shape: tuple[int, int, int, int]) -> None:
        self.tiers = list(tiers)
        self.kv_shape = kv_shape  # (num_layers, 2, kv_heads, head_dim)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def _valid(
        self, block: KVBlock | None, block_hash: bytes | None, parent_key: bytes, tokens: np.ndarray
    ) -> bool:
        if block is None:
            return False
        meta, kv = block.meta, block.kv
        L, two, H, D = self.kv_shape
        return (
            (block_hash is None or meta.block_hash == block_hash)
            and meta.parent_key == parent_key
            and np.array_equal(meta.token_ids, tokens)
            and tuple(kv.shape) == (L, two, H, len(tokens), D)
        )

    def fetch_full(
        self,
        hashes: Sequence[bytes],
        parent_keys: Sequence[bytes],
        tokens: np.ndarray,
        start: int,
        block_size: int,
        before_read: Callable[[int], object] | None = None,
        on_found: Callable[[int, Found], object] | None = None,
    ) -> list[Found]:
        """The run of full blocks `start, start+1, ...` that some tier holds, verified.
        `before_read(run)` is called once the run (its length) is known to be non-empty,
        before reading it; `on_found(i, found)` for block `start + i` as soon as it is
        read and verified, in no particular order, while the others are read (a block
        after the first failure may be among them)."""
        wanted = list(hashes[start:])
        if not wanted or not self.tiers:
            return []
        owner: list[KVTier | None] = [None] * len(wanted)
        for tier in self.tiers:
            todo = [i for i, o in enumerate(owner) if o is None]
            if not todo:
                break
            for i, present in zip(todo, tier.contains([wanted[i] for i in todo]), strict=True):
                if present:
                    owner[i] = tier
        run = next((i for i, o in enumerate(owner) if o is None), len(owner))
        if run and before_read is not None:
            before_read(run)
        found: list[Found | None] = [None] * run
        for tier in self.tiers:
            idx = [i for i in range(run) if owner[i] is tier]

            def verify(k: int, blk: KVBlock, idx: list[int] = idx, tier: KVTier = tier) -> None:
                i, n = idx[k], start + idx[k]
                toks = tokens[n * block_size : (n + 1) * block_size]
                if self._valid(blk, wanted[i], parent_keys[n], toks):
                    got = found[i] = Found(tier.name, blk)
                    if on_found is not None:
                        on_found(i, got)

            if idx:
                tier.get_each([wanted[i] for i in idx], verify)
        out: list[Found] = []
        for f in found:
            if f is None:
                break
            out.append(f)
        return out

    def fetch_partial(self, parent_key: bytes, next_tokens: np.ndarray) -> tuple[Found, int] | None:
        """The stored child of `parent_key` sharing the longest common prefix with
        `next_tokens`, and that prefix's length; None when no tier has one."""
        best: tuple[int, KVTier, BlockMeta] | None = None
        for tier in self.tiers:
            for meta in tier.children(parent_key):
                n = min(meta.num_tokens, len(next_tokens))
                diff = np.flatnonzero(meta.token_ids[:n] != next_tokens[:n])
                lcp = int(diff[0]) if len(diff) else n
                if lcp > 0 and (best is None or lcp > best[0]):
                    best = (lcp, tier, meta)
        if best is None:
            return None
        lcp, tier, meta = best
        (blk,) = tier.get([meta.block_hash])
        if not self._valid(blk, meta.block_hash, parent_key, meta.token_ids):
            return None
        assert blk is not None
        return Found(tier.name, blk), lcp

    def put(self, blocks: Sequence[KVBlock], skip: str | None = None) -> None:
        for tier in self.tiers:
            if tier.name != skip and blocks:
                tier.put(blocks)

    def flush(self, timeout: float) -> bool:
        return all(t.flush(timeout) for t in self.tiers)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
