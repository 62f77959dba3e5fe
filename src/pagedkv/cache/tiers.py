"""The tiers below RAM (SSD, then Redis), walked block by block."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from pagedkv.storage.base import BlockMeta, KVBlock, KVTier

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(slots=True)
class Found:
    """A verified block from a lower tier, with the name of the tier it came from."""

    tier: str
    block: KVBlock


class LowerTiers:
    """SSD and Redis behind the RAM tier.

    Every block a tier returns is checked against what the request expects
    (hash, parent key, token ids, KV shape and dtype, at most `block_size`
    tokens) before it is used: a tier's own checksum proves the bytes are
    intact, this proves they are the right bytes. A block that fails is a miss.
    Lookups stop at the first block no tier has.

    A tier that raises, or answers with something that is not what the contract
    says (a list of another length, objects that are not blocks), counts as
    having nothing for that call: the walk goes on with the other tiers and with
    what RAM matched, instead of failing the lookup. `failures` counts them; the
    first of each tier is logged with its traceback, since it is a bug there.
    """

    def __init__(
        self,
        tiers: Sequence[KVTier],
        kv_shape: tuple[int, int, int, int],
        *,
        block_size: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.tiers = list(tiers)
        self.kv_shape = kv_shape  # (num_layers, 2, kv_heads, head_dim)
        self.block_size = block_size  # None: not checked (the caller's block size)
        self.dtype = dtype  # None: any dtype
        self.failures = 0
        self._logged: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def _ask(self, tier: KVTier, what: str, op: Callable[[], _T], default: _T) -> _T:
        try:
            return op()
        except Exception:
            self.failures += 1
            first = tier.name not in self._logged
            self._logged.add(tier.name)
            log.warning(
                "%s tier: %s failed; treated as a miss (the request goes on without it)",
                tier.name, what, exc_info=first,
            )  # fmt: skip
            return default

    def _contains(self, tier: KVTier, hashes: list[bytes]) -> list[bool]:
        def op() -> list[bool]:
            got = tier.contains(hashes)
            if len(got) != len(hashes):
                raise ValueError(f"contains answered {len(got)} flags for {len(hashes)} hashes")
            return [x is True for x in got]

        return self._ask(tier, "contains", op, [False] * len(hashes))

    def _get(self, tier: KVTier, hashes: list[bytes]) -> list[KVBlock | None]:
        def op() -> list[KVBlock | None]:
            got = tier.get(hashes)
            if len(got) != len(hashes):
                raise ValueError(f"get answered {len(got)} blocks for {len(hashes)} hashes")
            return [b if isinstance(b, KVBlock) else None for b in got]

        return self._ask(tier, "get", op, [None] * len(hashes))

    def _get_each(
        self, tier: KVTier, hashes: list[bytes], on_block: Callable[[int, KVBlock], None]
    ) -> bool:
        """`tier.get_each`, guarded like `_get`: only real blocks at valid positions reach
        `on_block`. False when the tier raised or answered garbage: then the caller takes
        none of its answer, not even the blocks already handed over."""

        def checked(k: int, blk: object) -> None:
            if isinstance(blk, KVBlock) and 0 <= k < len(hashes):
                on_block(k, blk)

        def op() -> bool:
            got = tier.get_each(hashes, checked)
            if len(got) != len(hashes):
                raise ValueError(f"get answered {len(got)} blocks for {len(hashes)} hashes")
            return True

        return self._ask(tier, "get", op, False)

    def _children(self, tier: KVTier, parent_key: bytes) -> list[BlockMeta]:
        def op() -> list[BlockMeta]:
            return [
                m
                for m in tier.children(parent_key)
                if isinstance(m, BlockMeta)
                and isinstance(m.token_ids, np.ndarray)
                and m.token_ids.dtype == np.int32
                and m.token_ids.ndim == 1
            ]

        return self._ask(tier, "children", op, [])

    def _valid(
        self, block: KVBlock | None, block_hash: bytes | None, parent_key: bytes, tokens: np.ndarray
    ) -> bool:
        if block is None:
            return False
        meta, kv = block.meta, block.kv
        L, two, H, D = self.kv_shape
        return (
            isinstance(kv, torch.Tensor)
            and isinstance(meta, BlockMeta)
            and (block_hash is None or meta.block_hash == block_hash)
            and meta.parent_key == parent_key
            and isinstance(meta.token_ids, np.ndarray)
            and np.array_equal(meta.token_ids, tokens)
            and (self.block_size is None or len(tokens) <= self.block_size)
            and (self.dtype is None or kv.dtype == self.dtype)
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
            for i, present in zip(
                todo, self._contains(tier, [wanted[i] for i in todo]), strict=True
            ):
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

            if idx and not self._get_each(tier, [wanted[i] for i in idx], verify):
                for i in idx:
                    found[i] = None
        out: list[Found] = []
        for f in found:
            if f is None:
                break
            out.append(f)
        return out

    def fetch_partial(self, parent_key: bytes, next_tokens: np.ndarray) -> tuple[Found, int] | None:
        """The stored child of `parent_key` sharing the longest common prefix with
        `next_tokens`, and that prefix's length; None when no tier has one. A child
        of more than `block_size` tokens is not one (no request stores such a block)."""
        best: tuple[int, KVTier, BlockMeta] | None = None
        limit = self.block_size
        for tier in self.tiers:
            for meta in self._children(tier, parent_key):
                if limit is not None and meta.num_tokens > limit:
                    continue
                n = min(meta.num_tokens, len(next_tokens))
                diff = np.flatnonzero(meta.token_ids[:n] != next_tokens[:n])
                lcp = int(diff[0]) if len(diff) else n
                if lcp > 0 and (best is None or lcp > best[0]):
                    best = (lcp, tier, meta)
        if best is None:
            return None
        lcp, tier, meta = best
        (blk,) = self._get(tier, [meta.block_hash])
        if not self._valid(blk, meta.block_hash, parent_key, meta.token_ids):
            return None
        assert blk is not None
        return Found(tier.name, blk), lcp

    def put(self, blocks: Sequence[KVBlock], skip: str | None = None) -> None:
        for tier in self.tiers:
            if tier.name != skip and blocks:
                self._ask(tier, "put", partial(tier.put, blocks), None)

    def flush(self, timeout: float) -> bool:
        return all(t.flush(timeout) for t in self.tiers)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
