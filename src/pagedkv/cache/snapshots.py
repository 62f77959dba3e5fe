"""Recurrent-state snapshots kept beside the blocks, in RAM and in the lower tiers.

A snapshot is the model's recurrent state after the last token of a full block,
one flat float32 tensor (`pagedkv.model.state`, which the cache core never
imports: it sees a size). It is named by that block's hash, which names the whole
prefix up to the block's end, so a snapshot found under a block's hash is the
state after exactly that prefix, whichever request computed it.

In RAM the snapshots sit in their own LRU map under a byte budget, apart from
the block pool: a snapshot is useful only together with the KV of every block
before it, and the restore asks for both (it restores to the last boundary that
has both; a hit is never reported for KV without its state). Rejected: a slot
in the pool's slabs per block, which would reserve a snapshot's bytes for every
block while snapshots are taken every k blocks only.

In SSD and Redis a snapshot is an ordinary stored block under a derived hash
(`state_key`): the tiers need no new format. Its KV tensor is the flat state,
zero-padded to `[1, 1, 1, n, ceil(numel / n)]` for the block's n tokens, and its
parent key is derived too, so it never shows up as a child of a real block.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from pagedkv.cache.hashing import HashChain
from pagedkv.storage.base import BlockMeta, KVBlock, KVTier

_STATE_TAG = b"pagedkv-state/"
_PARENT_TAG = b"pagedkv-state-parent/"


def state_key(block_hash: bytes) -> bytes:
    """The hash a block's snapshot is stored under in the lower tiers."""
    return hashlib.blake2b(_STATE_TAG + block_hash, digest_size=len(block_hash)).digest()


class SnapshotStore:
    """Snapshots by block hash: an LRU map in RAM of at most `max_bytes`, written
    through to the lower tiers. Used by the worker thread only."""

    def __init__(
        self,
        numel: int,
        max_bytes: int,
        tiers: Sequence[KVTier],
        namespace: str,
        interval_tokens: int,
    ) -> None:
        self.numel = numel
        # A request snapshots its state every `interval_tokens` (its prefill chunks end
        # there); a restore takes any block boundary that has one.
        self.interval_tokens = interval_tokens
        self.nbytes = 4 * numel
        self.max_entries = max(1, max_bytes // max(1, self.nbytes))
        self.tiers = list(tiers)
        self.namespace = namespace
        self._ram: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits: dict[str, int] = {}
        self.stored = 0

    def __len__(self) -> int:
        return len(self._ram)

    @property
    def bytes_used(self) -> int:
        return len(self._ram) * self.nbytes

    def put(self, meta: BlockMeta, state: torch.Tensor) -> None:
        """Keep the snapshot taken after block `meta` and write it to the lower tiers
        (unless RAM already held it: then they were written when it came)."""
        if state.numel() != self.numel:
            raise ValueError(f"a snapshot of {state.numel()} values, the layout has {self.numel}")
        key = meta.block_hash
        if key in self._ram:
            self._ram.move_to_end(key)
            return
        self._remember(key, state.detach().to("cpu", torch.float32).contiguous())
        self.stored += 1
        if self.tiers:
            stored = self._encode(meta, self._ram[key])
            for tier in self.tiers:
                tier.put([stored])

    def put_prefix(
        self, chain: HashChain, num_tokens: int, block_size: int, state: torch.Tensor
    ) -> bool:
        """Keep the snapshot taken after the first `num_tokens` tokens of `chain`, as
        soon as it is taken; False when that is not the end of one of the chain's full
        blocks (the caller keeps it). The block's KV need not be cached yet: `find`
        only looks where KV was restored, so a snapshot without its KV is never used,
        and the one that arrives later completes it."""
        j, rest = divmod(num_tokens, block_size)
        if rest or not 0 < j <= len(chain.hashes):
            return False
        tokens = np.asarray(chain.tokens[(j - 1) * block_size : j * block_size], dtype=np.int32)
        self.put(BlockMeta(chain.hashes[j - 1], chain.parent_keys[j - 1], tokens, self.namespace),
                 state)  # fmt: skip
        return True

    def clear(self) -> None:
        """Forget the snapshots in RAM (the lower tiers clear by namespace)."""
        self._ram.clear()

    def _remember(self, key: bytes, state: torch.Tensor) -> None:
        self._ram[key] = state
        while len(self._ram) > self.max_entries:
            self._ram.popitem(last=False)

    def find(
        self, hashes: Sequence[bytes], tokens: np.ndarray, block_size: int, upto: int
    ) -> tuple[int, torch.Tensor | None]:
        """The longest prefix of at most `upto` full blocks of `hashes` whose snapshot
        some tier holds: (its number of blocks, the snapshot), or (0, None). RAM first;
        the lower tiers only for a longer prefix than RAM has."""
        ram_best = next((j for j in range(upto, 0, -1) if hashes[j - 1] in self._ram), 0)
        if ram_best < upto and self.tiers:
            lower = self._find_lower(hashes, tokens, block_size, upto, ram_best)
            if lower is not None:
                return lower
        if ram_best:
            self._ram.move_to_end(hashes[ram_best - 1])
            return self._hit("ram", ram_best, self._ram[hashes[ram_best - 1]])
        return 0, None

    def peek(self, hashes: Sequence[bytes], upto: int) -> int:
        """The number of blocks `find` would resume at (at most `upto`): no tier read, no
        counter, the LRU order untouched. Any thread: RAM is asked one membership test
        per block (each atomic under the GIL), the lower tiers `contains` (metadata).
        A lower-tier snapshot that turns out corrupt is a miss `find` sees and this
        does not, like any block explain reports from an index."""
        ram_best = next((j for j in range(upto, 0, -1) if hashes[j - 1] in self._ram), 0)
        if ram_best < upto and self.tiers:
            keys = [state_key(h) for h in hashes[ram_best:upto]]
            for tier in self.tiers:
                try:
                    present = tier.contains(keys)
                except Exception:  # a failing tier is a miss, as for `find`'s caller
                    continue
                best = next((i for i in range(len(keys), 0, -1) if present[i - 1]), 0)
                if best:
                    return ram_best + best
        return ram_best

    def _hit(self, tier: str, num_blocks: int, state: torch.Tensor) -> tuple[int, torch.Tensor]:
        self.hits[tier] = self.hits.get(tier, 0) + 1
        return num_blocks, state

    def _find_lower(
        self,
        hashes: Sequence[bytes],
        tokens: np.ndarray,
        block_size: int,
        upto: int,
        above: int,
    ) -> tuple[int, torch.Tensor] | None:
        keys = [state_key(h) for h in hashes[above:upto]]
        for tier in self.tiers:
            present = tier.contains(keys)
            for j in range(upto, above, -1):
                if not present[j - 1 - above]:
                    continue
                (blk,) = tier.get([keys[j - 1 - above]])
                want = tokens[(j - 1) * block_size : j * block_size]
                state = self._decode(blk, keys[j - 1 - above], hashes[j - 1], want)
                if state is None:
                    continue
                self._remember(hashes[j - 1], state)
                return self._hit(tier.name, j, state)
        return None

    def _encode(self, meta: BlockMeta, state: torch.Tensor) -> KVBlock:
        n = max(1, meta.num_tokens)
        width = math.ceil(self.numel / n)
        packed = torch.zeros(n * width, dtype=torch.float32)
        packed[: self.numel] = state
        key = state_key(meta.block_hash)
        parent = hashlib.blake2b(_PARENT_TAG + meta.block_hash, digest_size=len(key)).digest()
        stored = BlockMeta(key, parent, meta.token_ids, self.namespace)
        return KVBlock(stored, packed.view(1, 1, 1, n, width))

    def _decode(
        self, blk: KVBlock | None, key: bytes, block_hash: bytes, tokens: np.ndarray
    ) -> torch.Tensor | None:
        """The snapshot in a stored block, or None when it is not the one asked for."""
        if blk is None or blk.meta.block_hash != key or blk.kv.dtype != torch.float32:
            return None
        n = max(1, len(tokens))
        want_parent = hashlib.blake2b(_PARENT_TAG + block_hash, digest_size=len(key)).digest()
        if (
            blk.meta.parent_key != want_parent
            or not np.array_equal(blk.meta.token_ids, tokens)
            or tuple(blk.kv.shape) != (1, 1, 1, n, math.ceil(self.numel / n))
        ):
            return None
        return blk.kv.reshape(-1)[: self.numel].clone()
